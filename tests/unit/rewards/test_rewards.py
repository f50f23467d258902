import threading
import time

import pytest

from vapo_megatron.rewards import GradeResult
from vapo_megatron.rewards.dapo_math import grade, normalize_final_answer
from vapo_megatron.rewards.registry import (
    DEFAULT_ROUTING,
    check_data_sources,
    get_grader,
    register_grader,
    resolve_routing,
    score_responses,
)

pytestmark = pytest.mark.unit

FILLER = "Let me think about this carefully. " * 20  # 700 characters


@pytest.mark.parametrize(
    ("response", "ground_truth", "correct"),
    [
        ("So the sum is 3.\nAnswer: 3", "3", True),
        ("So the sum is 3.\nAnswer: 4", "3", False),
        ("No answer line at all, the result is 3", "3", False),
        ("The answer is 3", "3", False),  # no colon: not an answer line
        ("answer: 3", "3", True),  # any case
        ("ANSWER :   3   ", "3", True),  # whitespace around
        ("Answer: 5\nwait, no.\nAnswer: 3", "3", True),  # the last answer line wins
        ("Answer: 3\nwait, no.\nAnswer: 5", "3", False),
        ("Answer: 3 and more text\nsomething", "3", False),  # the whole line is the answer
        ("Answer: $\\boxed{3}$", "3", True),
        ("Answer: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True),
        ("Answer: $\\frac12$", "\\frac{1}{2}", True),  # brace shorthand
        ("Answer: 0.5", "\\frac{1}{2}", False),  # no equivalence check
        ("Answer: $x = 7$", "7", True),  # right side of '='
        ("Answer: 1,000", "1000", True),
        ("Answer: 1000", "1,000", True),  # the ground truth is normalised too
        ("Answer: 1,000.5", "1000.5", False),  # commas stay in non-integers
        ("Answer: 12 units", "12", True),
        ("Answer: 90^\\circ", "90", True),
        ("Answer: \\text{(A)}", "(A)", True),
        ("Answer: 3" + "\n" + FILLER, "3", False),  # beyond the last 300 characters
        (FILLER + "\nAnswer: 3", "3", True),
    ],
)
def test_dapo_math_grade(response, ground_truth, correct):
    result = grade(response, ground_truth)
    assert (result.score, result.acc) == ((1.0, 1.0) if correct else (-1.0, 0.0))


def test_dapo_math_invalid_and_pred():
    assert grade("nothing here", "3").pred == "[INVALID]"
    assert grade("Answer: $\\boxed{1,000}$", "1000").pred == "1000"


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        ("\\$5", "5"),
        ("an apple", "apple"),
        ("\\text{m}", ""),
        ("5 \\text{ cm}", "5"),
        ("\\textbf{7}", "7"),
        ("\\overline{12}", "12"),
        ("\\sqrt2", "\\sqrt{2}"),
        ("(1,2)", "(1,2)"),
        ("x\\text{ and }y", "x,y"),
        ("10\\;000", "10000"),
        ("5\\ldots", "5"),
    ],
)
def test_normalize_final_answer(raw, normalized):
    assert normalize_final_answer(raw) == normalized


def test_routing_and_registry():
    routing = resolve_routing({"gsm8k": "dapo_math"})
    assert routing["math_dapo"] == routing["aime2024"] == routing["gsm8k"] == "dapo_math"
    assert {"aime", "math"} <= set(DEFAULT_ROUTING)
    assert get_grader("dapo_math")("Answer: 2", "2") == GradeResult(score=1.0, acc=1.0, pred="2")
    check_data_sources({"math_dapo", "gsm8k"}, routing)
    with pytest.raises(ValueError, match=r"\['olympiad'\] has no grader.*reward\.routing"):
        check_data_sources({"olympiad", "math"}, routing)
    with pytest.raises(ValueError, match=r"grader\(s\) \['nope'\] that are not registered"):
        check_data_sources({"x"}, {"x": "nope"})
    with pytest.raises(ValueError, match="no grader named 'nope'"):
        get_grader("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_grader("dapo_math", grade)


def test_score_responses_survives_slow_and_failing_graders():
    release = threading.Event()

    def stuck(response, ground_truth):
        if response == "stuck":
            release.wait(30)
        return GradeResult(score=5.0, acc=1.0)

    def broken(response, ground_truth):
        raise RuntimeError("grader bug")

    register_grader("test_stuck", stuck, wrong=GradeResult(score=0.0, acc=0.0), replace=True)
    register_grader("test_broken", broken, replace=True)
    routing = resolve_routing({"slow": "test_stuck", "bad": "test_broken"})
    items = [
        ("math_dapo", "Answer: 1", "1"),
        ("slow", "stuck", ""),
        ("slow", "fine", ""),
        ("bad", "Answer: 1", "1"),
        ("math_dapo", "Answer: 2", "1"),
    ]
    start = time.monotonic()
    results, stats = score_responses(items, routing, timeout_s=0.3)
    elapsed = time.monotonic() - start
    release.set()
    assert [(r.score, r.acc) for r in results] == [
        (1.0, 1.0),
        (0.0, 0.0),  # timed out: the grader's declared wrong verdict
        (5.0, 1.0),  # the next response on a fresh worker
        (-1.0, 0.0),  # raised: the default wrong verdict
        (-1.0, 0.0),
    ]
    assert (stats.num_responses, stats.num_timeouts, stats.num_errors) == (5, 1, 1)
    assert stats.first_error == "bad: RuntimeError: grader bug"
    assert 0.3 <= elapsed < 3.0
    with pytest.raises(ValueError, match="has no grader"):
        score_responses([("olympiad", "Answer: 1", "1")], routing, timeout_s=1.0)
    assert score_responses([], routing, timeout_s=1.0)[0] == []
