"""The verifier of the long-trace task (``tiny/long_trace.py``): the answer line alone.

The response must end with the line ``Answer: N`` (trailing whitespace and the end-of-text
token's absence aside); it is correct when N, an integer, equals the ground truth. The lines
before it are not read: a slip anywhere in the trace shows only as a wrong answer, so the
reward says nothing about where the response went wrong (a reward at the last token only).
A response whose last line is not an answer line (cut at max_new_tokens, or rambling on) is
wrong. Scores are DAPO's: +1.0 correct, -1.0 wrong.
"""

from __future__ import annotations

import re

from vapo_megatron.rewards import GradeResult

ANSWER_LINE = re.compile(r"Answer: (\d+)")
"""The last line of a complete response."""
CORRECT = GradeResult(score=1.0, acc=1.0)
WRONG = GradeResult(score=-1.0, acc=0.0)
"""The verdict for a wrong response, also given when grading fails or times out."""


def grade(response: str, ground_truth: str) -> GradeResult:
    """+1 when the response's last line is ``Answer: <ground_truth>``, else -1."""
    if not ground_truth.strip().isdigit():
        raise ValueError(
            f"long_trace ground truth must be a non-negative integer, got {ground_truth!r}; "
            "rows come from tiny/long_trace.py"
        )
    lines = response.rstrip().split("\n")
    match = ANSWER_LINE.fullmatch(lines[-1].strip())
    if match is None:
        return WRONG
    pred = match[1]
    if int(pred) == int(ground_truth):
        return GradeResult(score=1.0, acc=1.0, pred=pred)
    return GradeResult(score=-1.0, acc=0.0, pred=pred)
