"""Rule-based graders of responses: ``registry.py`` routes a row's data_source to a grader."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class GradeResult:
    """A grader's verdict on one response."""

    score: float
    """The reward (DAPO math: +1.0 correct, -1.0 wrong)."""
    acc: float
    """1.0 if the response is correct, else 0.0."""
    pred: str | None = None
    """The answer the grader read from the response, normalised (for logs); None if not given."""
