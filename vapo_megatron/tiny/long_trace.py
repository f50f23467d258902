"""A synthetic task with long, variable-length reasoning: trace a register through a short program.

A problem gives a start value (0..9), a program of 2 to ``MAX_OPS`` lettered operations (each
adds or subtracts 1..9, modulo 100) and a number of rounds (1..9), e.g.
"Run 2 rounds from 7: a=+7 b=-3 c=+5". The worked solution applies the program round after
round, one operation a line, naming the round and the operation, and ends with the answer line::

    1 a:7+7=14
    1 b:14-3=11
    1 c:11+5=16
    2 a:16+7=23
    2 b:23-3=20
    2 c:20+5=25
    Answer: 25

Every step is the same small lookup (the operation by its letter, the next letter and round by
the previous line's) and one sum modulo 100. Every number in a prompt is one digit, so a
prompt is the same tokens whichever way digits are grouped (transformers' Qwen2 tokenizer
splits every digit, the tiny tokenizer groups them; see long_model.py); the numbers of the
responses, which only the model writes, are each one token of the tiny tokenizer, ~9 tokens
a line. Rounds x operations run from 2 to 63 lines: responses of ~25 to ~575 tokens, mean
~210, spread over the whole range: long chain-of-thought in miniature.

A slip (``worked_solution(..., slip_rate=)``) is a line whose result is off by 1 or 2 and is
carried on, so a slip on any line, the first or the fifty-fifth, breaks the answer. The tiny
policy is warmed up on solutions that slip (``long_model.write_long_policy``): it knows every
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

MAX_ROUNDS = 9
"""Rounds (passes through the program) run from 1 to MAX_ROUNDS: one digit in the prompt."""
MIN_OPS = 2
MAX_OPS = 7
"""Operations in a program, named a..g; steps = rounds x operations, 2 to 63 lines."""
MAX_START = 9
"""The start value is 0..MAX_START: one digit in the prompt."""
MAX_OPERAND = 9
"""Each operation adds or subtracts 1..MAX_OPERAND."""
MODULUS = 100
"""Values stay in 0..MODULUS-1 (one token each in the responses)."""
DATA_SOURCE = "long_trace"
"""The rows' data_source; the reward registry routes it to the long_trace verifier."""
PREFIX = "Run "
SLIPS = (-2, -1, 1, 2)
"""How far a slipped line's result is off (modulo MODULUS)."""
_LETTERS = string.ascii_lowercase[:MAX_OPS]
_PROMPT = re.compile(r"Run (\d) rounds from (\d): (.+)")
_OP = re.compile(r"([a-z])=([-+])(\d)")
_MAX_DRAWS_PER_ROW = 100

Problem = tuple[int, int, list[tuple[str, int]]]
"""(rounds, start value, program as (op '+'/'-', operand) in letter order)."""


def make_problem(rng: random.Random) -> tuple[str, str, str]:
    """One problem drawn with ``rng``: (prompt text, answer string, solution text)."""
    rounds = rng.randint(1, MAX_ROUNDS)
    start = rng.randint(0, MAX_START)
    program = [
        (rng.choice("+-"), rng.randint(1, MAX_OPERAND))
        for _ in range(rng.randint(MIN_OPS, MAX_OPS))
    ]
    problem = (rounds, start, program)
    answer, solution = worked_solution(problem)
    return format_prompt(problem), answer, solution


def format_prompt(problem: Problem) -> str:
    """The prompt text of ``problem``."""
    rounds, start, program = problem
    ops = " ".join(f"{_LETTERS[i]}={op}{x}" for i, (op, x) in enumerate(program))
    return f"{PREFIX}{rounds} rounds from {start}: {ops}"


def parse(prompt: str) -> Problem:
    """The problem of a prompt written by make_problem, read from its text."""
    match = _PROMPT.fullmatch(prompt)
    if match is None:
        raise ValueError(f"not a long_trace problem: {prompt!r}")
    ops = [_OP.fullmatch(term) for term in match[3].split(" ")]
    rounds, start = int(match[1]), int(match[2])
    if (
        any(m is None for m in ops)
        or "".join(m[1] for m in ops) != _LETTERS[: len(ops)]
        or not MIN_OPS <= len(ops) <= MAX_OPS
        or not 1 <= rounds
    ):
        raise ValueError(f"not a long_trace problem: {prompt!r}")
    return rounds, start, [(m[2], int(m[3])) for m in ops]


def solve(prompt: str) -> tuple[str, str]:
    """(answer, solution) of a prompt written by make_problem, recomputed from its text."""
    return worked_solution(parse(prompt))


def worked_solution(
    problem: Problem, *, slip_rate: float = 0.0, rng: random.Random | None = None
) -> tuple[str, str]:
    """(answer, solution): one line per step (its round and its operation's letter), then the
    answer line.

    With ``slip_rate`` > 0 each line's result is, with that probability (drawn from ``rng``),
    off by one of ``SLIPS`` modulo MODULUS, and the next lines go on from it: the returned
    answer is then the slipped chain's (wrong, unless a later slip happens to cancel it).
    """
    if not 0.0 <= slip_rate < 1.0:
        raise ValueError(f"slip_rate must be in [0, 1), got {slip_rate}")
    if slip_rate > 0 and rng is None:
        raise ValueError("slip_rate > 0 needs an rng to draw the slips from")
    rounds, value, program = problem
    lines = []
    for i in range(rounds * len(program)):
        op, operand = program[i % len(program)]
        result = (value + operand if op == "+" else value - operand) % MODULUS
        if slip_rate > 0 and rng.random() < slip_rate:
            result = (result + rng.choice(SLIPS)) % MODULUS
        round_, letter = i // len(program) + 1, _LETTERS[i % len(program)]
        lines.append(f"{round_} {letter}:{value}{op}{operand}={result}")
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


def read_rows(path: str | Path) -> list[dict[str, str]]:
    """The rows of a JSONL split written by make_splits."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
