"""A synthetic task with long, variable-length reasoning: trace a register through a short program.

A problem gives a start value, a program of 2 to ``MAX_OPS`` lettered operations (each adds or
subtracts 1..9, modulo 100) and a number of steps, e.g.
"Run 5 steps from 37: a=+7 b=-3 c=+5". The worked solution applies the program cyclically, one
step a line, numbering the lines and naming the operation, and ends with the answer line::

    1 a:37+7=44
    2 b:44-3=41
    3 c:41+5=46
    4 a:46+7=53
    5 b:53-3=50
    Answer: 50

Every step is the same small lookup (the operation by its letter, the letter by the previous
one, the line number by the previous one) and one sum modulo 100, so every number is one token
of the tiny tokenizer and every line has the same shape (~9 tokens). The steps run from
``MIN_STEPS`` to ``MAX_STEPS``, drawn with more weight on the short end (``_draw_steps``), so
responses run from ~40 to ~550 tokens (mean ~180): long chain-of-thought in miniature.

A slip (``worked_solution(..., slip_rate=)``) is a line whose result is off by 1 or 2 and is
carried on, so a slip on any line, the first or the fifty-fifth, breaks the answer. The tiny
policy is warmed up on solutions that slip (``tiny_long.write_long_policy``): it knows every
step, slips at about that rate a line, and its pass rate falls with the response's length.
The verifier (``rewards/long_trace.py``) reads the answer line alone: a reward at the last
token, which the critic has to carry back over hundreds of tokens to the slip.

Rows are written in the plain prompt schema ``{"prompt", "answer", "data_source"}`` with
``data_source`` ``DATA_SOURCE``, which the reward registry routes to that verifier.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Collection
from pathlib import Path

MIN_STEPS = 4
"""Fewest steps (solution lines before the answer)."""
MAX_STEPS = 60
"""Most steps: with the answer line ~550 tokens."""
STEPS_SKEW = 2.5
"""Steps are MIN_STEPS + (MAX_STEPS - MIN_STEPS) * u ** STEPS_SKEW, u uniform: more short ones."""
MIN_OPS = 2
MAX_OPS = 4
"""Operations in a program, named a, b, c, d."""
MAX_OPERAND = 9
"""Each operation adds or subtracts 1..MAX_OPERAND."""
MODULUS = 100
"""Values stay in 0..MODULUS-1 (one token each)."""
DATA_SOURCE = "long_trace"
"""The rows' data_source; the reward registry routes it to the long_trace verifier."""
PREFIX = "Run "
SLIPS = (-2, -1, 1, 2)
"""How far a slipped line's result is off (modulo MODULUS)."""
_LETTERS = string.ascii_lowercase[:MAX_OPS]
_PROMPT = re.compile(r"Run (\d+) steps from (\d+): (.+)")
_OP = re.compile(r"([a-z])=([-+])(\d)")
_MAX_DRAWS_PER_ROW = 100

Problem = tuple[int, int, list[tuple[str, int]]]
"""(steps, start value, program as (op '+'/'-', operand) in letter order)."""


def make_problem(rng: random.Random) -> tuple[str, str, str]:
    """One problem drawn with ``rng``: (prompt text, answer string, solution text)."""
    steps = _draw_steps(rng)
    start = rng.randrange(MODULUS)
    program = [
        (rng.choice("+-"), rng.randint(1, MAX_OPERAND))
        for _ in range(rng.randint(MIN_OPS, MAX_OPS))
    ]
    problem = (steps, start, program)
    answer, solution = worked_solution(problem)
    return format_prompt(problem), answer, solution


def format_prompt(problem: Problem) -> str:
    """The prompt text of ``problem``."""
    steps, start, program = problem
    ops = " ".join(f"{_LETTERS[i]}={op}{x}" for i, (op, x) in enumerate(program))
    return f"{PREFIX}{steps} steps from {start}: {ops}"


def parse(prompt: str) -> Problem:
    """The problem of a prompt written by make_problem, read from its text."""
    match = _PROMPT.fullmatch(prompt)
    if match is None:
        raise ValueError(f"not a long_trace problem: {prompt!r}")
    ops = [_OP.fullmatch(term) for term in match[3].split(" ")]
    steps, start = int(match[1]), int(match[2])
    if (
        any(m is None for m in ops)
        or "".join(m[1] for m in ops) != _LETTERS[: len(ops)]
        or not MIN_OPS <= len(ops) <= MAX_OPS
        or not 1 <= steps
        or not 0 <= start < MODULUS
    ):
        raise ValueError(f"not a long_trace problem: {prompt!r}")
    return steps, start, [(m[2], int(m[3])) for m in ops]


def solve(prompt: str) -> tuple[str, str]:
    """(answer, solution) of a prompt written by make_problem, recomputed from its text."""
    return worked_solution(parse(prompt))


def worked_solution(
    problem: Problem, *, slip_rate: float = 0.0, rng: random.Random | None = None
) -> tuple[str, str]:
    """(answer, solution): one numbered line per step, then the answer line.

    With ``slip_rate`` > 0 each line's result is, with that probability (drawn from ``rng``),
    off by one of ``SLIPS`` modulo MODULUS, and the next lines go on from it: the returned
    answer is then the slipped chain's (wrong, unless a later slip happens to cancel it).
    """
    if not 0.0 <= slip_rate < 1.0:
        raise ValueError(f"slip_rate must be in [0, 1), got {slip_rate}")
    if slip_rate > 0 and rng is None:
        raise ValueError("slip_rate > 0 needs an rng to draw the slips from")
    steps, value, program = problem
    lines = []
    for i in range(steps):
        op, operand = program[i % len(program)]
        result = (value + operand if op == "+" else value - operand) % MODULUS
        if slip_rate > 0 and rng.random() < slip_rate:
            result = (result + rng.choice(SLIPS)) % MODULUS
        lines.append(f"{i + 1} {_LETTERS[i % len(program)]}:{value}{op}{operand}={result}")
        value = result
    lines.append(f"Answer: {value}")
    return str(value), "\n".join(lines)


def first_slip(prompt: str, response: str) -> int | None:
    """The 0-based index of the first line of ``response`` that differs from the correct
    solution of ``prompt``, or None when every line of the correct solution is there."""
    correct = solve(prompt)[1].split("\n")
    lines = response.strip().split("\n")
    for i, line in enumerate(correct):
        if i >= len(lines) or lines[i] != line:
            return i
    return None if len(lines) == len(correct) else len(correct)


def make_rows(n: int, seed: int, *, exclude: Collection[str] = ()) -> list[dict[str, str]]:
    """``n`` rows with distinct prompts, none in ``exclude``, drawn from ``seed``."""
    rng = random.Random(seed)
    seen = set(exclude)
    rows: list[dict[str, str]] = []
    draws = 0
    while len(rows) < n:
        draws += 1
        if draws > _MAX_DRAWS_PER_ROW * max(n, 1):
            raise ValueError(f"could not draw {n} distinct problems (got {len(rows)})")
        prompt, answer, _ = make_problem(rng)
        if prompt in seen:
            continue
        seen.add(prompt)
        rows.append({"prompt": prompt, "answer": answer, "data_source": DATA_SOURCE})
    return rows


def make_splits(out_dir: str | Path, n_train: int, n_eval: int, seed: int) -> tuple[Path, Path]:
    """Writes ``out_dir/train.jsonl`` and ``out_dir/eval.jsonl`` (no prompt in both); returns
    their paths. The eval split is drawn first, from ``seed + 1``; the train split from ``seed``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    eval_rows = make_rows(n_eval, seed + 1)
    train_rows = make_rows(n_train, seed, exclude={row["prompt"] for row in eval_rows})
    paths = out_dir / "train.jsonl", out_dir / "eval.jsonl"
    for path, rows in zip(paths, (train_rows, eval_rows), strict=True):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths


def _draw_steps(rng: random.Random) -> int:
    return MIN_STEPS + round((MAX_STEPS - MIN_STEPS) * rng.random() ** STEPS_SKEW)


def read_rows(path: str | Path) -> list[dict[str, str]]:
    """The rows of a JSONL split written by make_splits."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
