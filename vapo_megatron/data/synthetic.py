"""A synthetic verifiable reasoning task: arithmetic chains whose worked solutions vary in length.

Two kinds of problem, each over 2 to ``MAX_TERMS`` operands from 1 to 9:

- ``sum``: "Add the numbers: 3 5 8 2", solved as running sums.
- ``chain``: "Evaluate left to right: 3+5*2-4" (no precedence), solved one operation a line.

The solution writes each partial result on its own line and ends with the line DAPO's grader
reads, e.g. ``"3+5=8\\n8*2=16\\n16-4=12\\nAnswer: 12"``; the ground truth is the plain integer
string (``"12"``). A ``*`` is only drawn when the product stays within ``MAX_ABS_VALUE``, so
numbers stay short and the alphabet is digits, ``+ - * =``, space, newline and a few words.
One operation a line makes the length of the reasoning grow with the number of operands: a
2-operand problem is solved in one line, a 12-operand one in eleven.

Rows are written in the plain prompt schema ``{"prompt", "answer", "data_source"}`` with
``data_source`` "math_dapo", so DAPO's grader scores the responses.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Collection
from pathlib import Path

MIN_TERMS = 2
"""Fewest operands of a problem (one solution line)."""
MAX_TERMS = 12
"""Most operands of a problem (eleven solution lines)."""
MAX_OPERAND = 9
"""Operands are drawn from 1..MAX_OPERAND."""
MAX_ABS_VALUE = 99
"""A chain's '*' is only drawn when the partial result stays within +-MAX_ABS_VALUE."""
DATA_SOURCE = "math_dapo"
"""The rows' data_source: the grader that scores them."""
SUM_PREFIX = "Add the numbers: "
CHAIN_PREFIX = "Evaluate left to right: "
_MAX_DRAWS_PER_ROW = 100


def make_problem(rng: random.Random) -> tuple[str, str, str]:
    """One problem drawn with ``rng``: (prompt text, answer string, solution text)."""
    num_terms = rng.randint(MIN_TERMS, MAX_TERMS)
    operands = [rng.randint(1, MAX_OPERAND) for _ in range(num_terms)]
    if rng.random() < 0.5:
        ops = ["+"] * (num_terms - 1)
        prompt = SUM_PREFIX + " ".join(map(str, operands))
    else:
        ops = []
        value = operands[0]
        for operand in operands[1:]:
            allowed = ["+", "-"] + (["*"] if abs(value * operand) <= MAX_ABS_VALUE else [])
            ops.append(rng.choice(allowed))
            value = _apply(value, ops[-1], operand)
        expression = str(operands[0]) + "".join(
            f"{op}{x}" for op, x in zip(ops, operands[1:], strict=True)
        )
        prompt = CHAIN_PREFIX + expression
    answer, solution = _worked_solution(operands, ops)
    return prompt, answer, solution


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


def solve(prompt: str) -> tuple[str, str]:
    """(answer, solution) of a prompt written by make_problem, recomputed from its text."""
    if prompt.startswith(SUM_PREFIX):
        operands = [int(x) for x in prompt[len(SUM_PREFIX) :].split()]
        ops = ["+"] * (len(operands) - 1)
    elif prompt.startswith(CHAIN_PREFIX):
        tokens = re.findall(r"\d+|[-+*]", prompt[len(CHAIN_PREFIX) :])
        operands = [int(x) for x in tokens[::2]]
        ops = tokens[1::2]
    else:
        raise ValueError(f"not a synthetic problem: {prompt!r}")
    return _worked_solution(operands, ops)


def read_rows(path: str | Path) -> list[dict[str, str]]:
    """The rows of a JSONL split written by write_split."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _worked_solution(operands: list[int], ops: list[str]) -> tuple[str, str]:
    """(answer, solution): one line per operation, then the answer line."""
    lines = []
    value = operands[0]
    for op, operand in zip(ops, operands[1:], strict=True):
        result = _apply(value, op, operand)
        lines.append(f"{value}{op}{operand}={result}")
        value = result
    lines.append(f"Answer: {value}")
    return str(value), "\n".join(lines)


def _apply(value: int, op: str, operand: int) -> int:
    if op == "+":
        return value + operand
    if op == "-":
        return value - operand
    assert op == "*", op
    return value * operand
