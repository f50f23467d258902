"""tools/probe_tiny_long.py: each character and token of a worked trace gets its part of the
line, merged tokens are named by both parts, and the probe runs on the shipped policy."""

from __future__ import annotations

import sys

import pytest

from tests.launcher import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))
from probe_tiny_long import ORDER, char_parts, probe, token_parts  # noqa: E402

pytestmark = pytest.mark.unit

TRACE = "1 a:7+7=14\n1 b:14-3=11\nAnswer: 11"


def test_every_character_has_its_part():
    parts = char_parts(TRACE)
    assert len(parts) == len(TRACE)
    first = ["round", "letter", "letter", ":", "value", "sign", "operand", "=", "result",
             "result", "newline"]  # fmt: skip
    assert parts[: len(first)] == first
    assert parts[len(first) + 4 : len(first) + 6] == ["value", "value"]  # "14", two digits
    assert parts[-10:] == ["Answer:"] * 7 + ["answer"] * 3  # "Answer:" then " 11"


def test_a_token_over_several_parts_is_named_by_each():
    # "1", " a:", "7", "+", "7", "=", "14", "\n": the second token merges the letter and ':'.
    offsets = [(0, 1), (1, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 10), (10, 11)]
    assert token_parts(TRACE, offsets) == [
        "round", "letter+:", "value", "sign", "operand", "=", "result", "newline",
    ]  # fmt: skip


def test_a_line_of_another_shape_is_refused():
    with pytest.raises(ValueError, match="line 1 of the solution"):
        char_parts("1 a:7+7=14\n1 b:14*3=42\nAnswer: 42")


def test_probe_of_the_shipped_policy():
    model = REPO_ROOT / "vapo_megatron" / "tiny" / "long" / "model"
    result = probe(model, model.parent / "eval.jsonl", prompts=4)
    assert result["prompts"] == 4
    assert list(result["p_correct"]) == list(ORDER)  # every part, in a line's order
    assert all(0.0 < p <= 1.0 for p in result["p_correct"].values())
    assert 0.0 <= result["expected_pass_t1"] <= 1.0
    assert 0.0 <= result["greedy_lines_right"] <= 1.0
