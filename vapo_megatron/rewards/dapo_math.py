"""DAPO's math grader, with the behaviour of verl's ``reward_score/math_dapo.compute_score``
(``strict_box_verify=False``), the reward DAPO and VAPO train with.

1. Only the last 300 characters of the response are read (the longest MATH-500 answer is 159).
2. The answer is the last match of ``Answer\\s*:\\s*([^\\n]+)`` (any case); none: "[INVALID]".
3. The answer and the ground truth both go through ``normalize_final_answer`` (Minerva's
   normalisation: units and words removed, ``\\text{}`` / ``\\boxed{}`` unwrapped, ``$`` dropped,
   thousands commas removed from plain numbers, ...).
4. Correct when the two normalised strings are equal: score +1.0, acc 1.0; else -1.0, 0.0.

No mathematical equivalence is tried: "0.5" and "\\frac{1}{2}" differ, as they do for DAPO.
"""

from __future__ import annotations

import re

from vapo_megatron.rewards import GradeResult

RESPONSE_TAIL_CHARS = 300
"""How many trailing characters of the response are searched for the answer."""
ANSWER_PATTERN = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)
"""The answer line; the last match in the tail wins."""
INVALID = "[INVALID]"
"""What a response without an answer line is read as (never equal to a ground truth)."""
CORRECT = GradeResult(score=1.0, acc=1.0)
WRONG = GradeResult(score=-1.0, acc=0.0)
"""The verdict for a wrong response, also given when grading fails or times out."""

# Plain-text replacements, applied in this order (order matters: "an " before " ").
_REPLACEMENTS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
# Units, filler words and TeX spacing deleted after the replacements, in this order.
_DELETIONS = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
# Regex rewrites after the deletions: keep what lies between the first two `$`, unwrap
# \text{} \textbf{} \overline{} (shortest content) and \boxed{} (longest), then brace
# shorthand \frac12 -> \frac{1}{2} and \sqrt2 -> \sqrt{2}.
_REWRITES = (
    (re.compile(r"(.*?)\$(.*?)\$(.*)"), r"$\2$"),
    (re.compile(r"\\text\{(.*?)\}"), r"\1"),
    (re.compile(r"\\textbf\{(.*?)\}"), r"\1"),
    (re.compile(r"\\overline\{(.*?)\}"), r"\1"),
    (re.compile(r"\\boxed\{(.*)\}"), r"\1"),
    (re.compile(r"frac([^{])(.)"), r"frac{\1}{\2}"),
    (re.compile(r"sqrt([^{])"), r"sqrt{\1}"),
)


def normalize_final_answer(answer: str) -> str:
    """Minerva's normalisation of a final answer, as DAPO applies it to answers and ground truths."""
    answer = answer.split("=")[-1]
    for old, new in _REPLACEMENTS:
        answer = answer.replace(old, new)
    for unwanted in _DELETIONS:
        answer = answer.replace(unwanted, "")
    for pattern, replacement in _REWRITES:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def extract_answer(response: str) -> str:
    """The raw text after the last "Answer:" in the response's tail, or INVALID."""
    matches = ANSWER_PATTERN.findall(response[-RESPONSE_TAIL_CHARS:])
    return matches[-1] if matches else INVALID


def grade(response: str, ground_truth: str) -> GradeResult:
    """DAPO's verdict on ``response`` against ``ground_truth`` (see the module doc)."""
    pred = normalize_final_answer(extract_answer(response))
    verdict = CORRECT if pred == normalize_final_answer(ground_truth) else WRONG
    return GradeResult(score=verdict.score, acc=verdict.acc, pred=pred)
