"""A synthetic verifiable reasoning task: arithmetic chains whose worked solutions vary in length.

A problem is a chain of 2 to ``MAX_TERMS`` terms, each named by a letter and evaluated left to
right (no precedence), e.g. "Evaluate left to right: a=7 b=-1 c=*5 d=+9". The worked solution
applies one term a line, naming it, and ends with the line DAPO's grader reads::

    b:7-1=6
    c:6*5=30
    d:30+9=39
    Answer: 39

The ground truth is the plain integer string (``"39"``). Operands run from 1 to 9 and an
operation is only drawn when the partial result stays within 0..``MAX_VALUE``, so every number
is one token of the tiny tokenizer and every line has the same shape. The letters make the
next operand a lookup by name rather than by position ("which is the sixth number?"), which a
two-layer model learns; the arithmetic of each line is what it has to get right. One term a
line makes the reasoning grow with the chain: 2 terms are solved in one line, 10 in nine.

Two kinds of imperfect solution make the tiny model's warm-up data (``tiny_model.warm_up``)
what a pretrained model's is, a mix of careful and careless reasoning:

- ``worked_solution(..., slip_rate=)``: slips, a line whose result is off by 1 or 2, carried
  on to the end (so the answer is wrong);
- ``guessed_solution``: a shortcut, the answer line alone with a guess near the answer.

The policy RL starts from then knows the arithmetic but often guesses instead of working, and
slips now and then; RL can raise its pass rate by working every problem out and by slipping
less, and its responses grow longer as it learns to (as the paper's do).

Rows are written in the plain prompt schema ``{"prompt", "answer", "data_source"}`` with
``data_source`` "math_dapo", so DAPO's grader scores the responses.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Collection
from pathlib import Path

MIN_TERMS = 2
"""Fewest terms of a problem (one solution line)."""
MAX_TERMS = 10
"""Most terms of a problem (nine solution lines); letters a..j name them."""
MAX_OPERAND = 9
"""Operands are drawn from 1..MAX_OPERAND."""
MAX_VALUE = 99
"""Every partial result stays within 0..MAX_VALUE: an operation that would leave it is not drawn."""
DATA_SOURCE = "math_dapo"
"""The rows' data_source: the grader that scores them."""
PREFIX = "Evaluate left to right: "
SLIPS = (-2, -1, 1, 2)
"""How far a slipped line's result is off."""
MAX_GUESS_OFF = 9
"""How far a guessed answer (``guessed_solution``) is off at most."""
_LETTERS = string.ascii_lowercase[:MAX_TERMS]
_TERM = re.compile(r"([a-z])=([-+*]?)(\d+)")
_MAX_DRAWS_PER_ROW = 100


def make_problem(rng: random.Random) -> tuple[str, str, str]:
    """One problem drawn with ``rng``: (prompt text, answer string, solution text)."""
    num_terms = rng.randint(MIN_TERMS, MAX_TERMS)
    operands = [rng.randint(1, MAX_OPERAND) for _ in range(num_terms)]
    ops: list[str] = []
    value = operands[0]
    for operand in operands[1:]:
        allowed = [op for op in "+-*" if 0 <= _apply(value, op, operand) <= MAX_VALUE]
        ops.append(rng.choice(allowed))
        value = _apply(value, ops[-1], operand)
    terms = [f"a={operands[0]}"] + [
        f"{letter}={op}{x}"
        for letter, op, x in zip(_LETTERS[1:num_terms], ops, operands[1:], strict=True)
    ]
    answer, solution = worked_solution(operands, ops)
    return PREFIX + " ".join(terms), answer, solution


def make_rows(n: int, seed: int, *, exclude: Collection[str] = ()) -> list[dict[str, str]]:
    """``n`` rows with distinct prompts, none in ``exclude``, drawn from ``seed``.

    A repeated or excluded prompt is redrawn whole, so the short problems (few distinct ones)
    grow rarer as they run out; past ``_MAX_DRAWS_PER_ROW`` draws a row the space is deemed
    exhausted.
    """
    rng = random.Random(seed)
    seen = set(exclude)
    rows = []
    draws = 0
    while len(rows) < n:
        draws += 1
        if draws > _MAX_DRAWS_PER_ROW * max(n, 1):
            raise ValueError(
                f"could not draw {n} distinct problems (got {len(rows)}) outside the "
                f"{len(exclude)} excluded; ask for fewer rows"
            )
        prompt, answer, _ = make_problem(rng)
        if prompt in seen:
            continue
        seen.add(prompt)
        rows.append({"prompt": prompt, "answer": answer, "data_source": DATA_SOURCE})
    return rows


def write_split(
    path: str | Path, n: int, seed: int, *, exclude: Collection[str] = ()
) -> list[dict[str, str]]:
    """Writes ``make_rows(n, seed, exclude=exclude)`` to ``path`` as JSONL; returns the rows."""
    rows = make_rows(n, seed, exclude=exclude)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows


def make_splits(out_dir: str | Path, n_train: int, n_eval: int, seed: int) -> tuple[Path, Path]:
    """Writes ``out_dir/train.jsonl`` and ``out_dir/eval.jsonl``; returns their paths.

    The eval split is drawn first (from ``seed + 1``) and its prompts are excluded from the
    train split (drawn from ``seed``), so the two share no prompt.
    """
    out_dir = Path(out_dir)
    eval_path, train_path = out_dir / "eval.jsonl", out_dir / "train.jsonl"
    eval_rows = write_split(eval_path, n_eval, seed + 1)
    write_split(train_path, n_train, seed, exclude={row["prompt"] for row in eval_rows})
    return train_path, eval_path


def parse(prompt: str) -> tuple[list[int], list[str]]:
    """(operands, operations) of a prompt written by make_problem, read from its text."""
    if not prompt.startswith(PREFIX):
        raise ValueError(f"not a synthetic problem: {prompt!r}")
    terms = prompt[len(PREFIX) :].split(" ")
    matches = [_TERM.fullmatch(term) for term in terms]
    letters = "".join(m[1] if m else "?" for m in matches)
    if (
        not MIN_TERMS <= len(terms) <= MAX_TERMS
        or letters != _LETTERS[: len(terms)]
        or matches[0][2]
        or not all(m[2] for m in matches[1:])
    ):
        raise ValueError(f"not a synthetic problem: {prompt!r}")
    return [int(m[3]) for m in matches], [m[2] for m in matches[1:]]


def solve(prompt: str) -> tuple[str, str]:
    """(answer, solution) of a prompt written by make_problem, recomputed from its text."""
    return worked_solution(*parse(prompt))


def worked_solution(
    operands: list[int],
    ops: list[str],
    *,
    slip_rate: float = 0.0,
    rng: random.Random | None = None,
) -> tuple[str, str]:
    """(answer, solution): one line per term, then the answer line.

    With ``slip_rate`` > 0 each line's result is, with that probability (drawn from ``rng``),
    off by one of ``SLIPS`` (one from which the rest of the chain stays within 0..MAX_VALUE),
    and the next lines go on from it: the returned answer is then the slipped chain's.
    """
    if not 0.0 <= slip_rate < 1.0:
        raise ValueError(f"slip_rate must be in [0, 1), got {slip_rate}")
    if slip_rate > 0 and rng is None:
        raise ValueError("slip_rate > 0 needs an rng to draw the slips from")
    lines = []
    value = operands[0]
    terms = list(zip(_LETTERS[1 : len(operands)], ops, operands[1:], strict=True))
    for i, (letter, op, operand) in enumerate(terms):
        result = _apply(value, op, operand)
        if slip_rate > 0 and rng.random() < slip_rate:
            result = _slip(result, terms[i + 1 :], rng)
        lines.append(f"{letter}:{value}{op}{operand}={result}")
        value = result
    lines.append(f"Answer: {value}")
    return str(value), "\n".join(lines)


def guessed_solution(answer: str, rng: random.Random) -> str:
    """A shortcut with no working: the answer line alone, with a guess off by 1 to ``MAX_GUESS_OFF``.

    The guess is never right, so a policy that learned to guess gains only by working.
    """
    value = int(answer)
    guesses = [
        value + d
        for d in range(-MAX_GUESS_OFF, MAX_GUESS_OFF + 1)
        if d != 0 and 0 <= value + d <= MAX_VALUE
    ]
    return f"Answer: {rng.choice(guesses)}"


def read_rows(path: str | Path) -> list[dict[str, str]]:
    """The rows of a JSONL split written by write_split."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _slip(result: int, rest: list[tuple[str, str, int]], rng: random.Random) -> int:
    """A wrong result near ``result`` from which the ``rest`` of the chain stays in range.

    ``result`` itself when no slip keeps every later partial result within 0..MAX_VALUE
    (rare: a chain that runs along a bound), so numbers stay single tokens.
    """
    wrong = [result + d for d in SLIPS if _stays_in_range(result + d, rest)]
    return rng.choice(wrong) if wrong else result


def _stays_in_range(value: int, rest: list[tuple[str, str, int]]) -> bool:
    for _, op, operand in [("", "+", 0), *rest]:
        value = _apply(value, op, operand)
        if not 0 <= value <= MAX_VALUE:
            return False
    return True


def _apply(value: int, op: str, operand: int) -> int:
    if op == "+":
        return value + operand
    if op == "-":
        return value - operand
    assert op == "*", op
    return value * operand
