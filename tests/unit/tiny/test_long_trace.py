"""The long-trace task (issue 29): its problems, worked solutions, slips, lengths and verifier."""

from __future__ import annotations

import random
import re
import statistics

import pytest

from vapo_megatron.rewards.long_trace import grade
from vapo_megatron.rewards.registry import resolve_routing, score_responses
from vapo_megatron.tiny.long_trace import (
    DATA_SOURCE,
    MAX_ROUNDS,
    MAX_START,
    first_slip,
    format_prompt,
    make_problem,
    make_rows,
    make_splits,
    parse,
    read_rows,
    solve,
    worked_solution,
)

pytestmark = pytest.mark.unit


def test_worked_solution_by_hand():
    problem = (3, 7, [("-", 9), ("+", 5)])
    answer, solution = worked_solution(problem)
    assert solution.split("\n") == [
        "1 a:7-9=98",  # modulo 100
        "1 b:98+5=3",
        "2 a:3-9=94",
        "2 b:94+5=99",
        "3 a:99-9=90",
        "3 b:90+5=95",
        "Answer: 95",
    ]
    assert answer == "95"
    assert format_prompt(problem) == "Run 3 rounds from 7: a=-9 b=+5"
    assert parse("Run 3 rounds from 7: a=-9 b=+5") == problem


def test_problems_round_trip_and_solve():
    rng = random.Random(3)
    for _ in range(200):
        prompt, answer, solution = make_problem(rng)
        rounds, start, program = parse(prompt)
        assert 1 <= rounds <= MAX_ROUNDS and 0 <= start <= MAX_START
        # One digit per number in the prompt: tokenized alike by any digit grouping.
        assert not re.search(r"\d\d", prompt)
        assert solve(prompt) == (answer, solution)
        assert len(solution.split("\n")) == rounds * len(program) + 1
        assert grade(solution, answer).acc == 1.0


@pytest.mark.parametrize(
    "prompt",
    ["Run 5 rounds from 9: a=+5", "Run 5 rounds from 9: b=+5 a=-8", "Run 5 rounds from 12: a=+5 b=-8",
     "Evaluate left to right: a=7 b=-1", "Run 0 rounds from 7: a=+5 b=-8"],
)  # fmt: skip
def test_parse_refuses_other_text(prompt):
    with pytest.raises(ValueError, match="not a long_trace problem"):
        parse(prompt)


def test_slips_anywhere_break_the_answer_and_are_found():
    """A slip on any line is carried to the end; first_slip names the line."""
    rng = random.Random(0)
    positions, wrong = [], []
    for _ in range(300):
        prompt, answer, _ = make_problem(rng)
        slipped_answer, slipped = worked_solution(parse(prompt), slip_rate=0.05, rng=rng)
        where = first_slip(prompt, slipped)
        if where is None:
            assert slipped_answer == answer
            continue
        rounds, _, program = parse(prompt)
        positions.append(where / (rounds * len(program)))
        wrong.append(grade(slipped, answer).acc == 0.0)
    assert len(positions) > 50
    assert statistics.mean(wrong) > 0.85  # a later slip cancels the first now and then (~11%)
    # Slips land early and late in the trace, not at one decision point.
    assert min(positions) < 0.2 and max(positions) > 0.8


def test_response_lengths_are_long_and_spread():
    """Mean >= 150 tokens, longest >= 500, at 9 tokens a line (the tiny tokenizer's count,
    measured: 9 per step line, 5 for the answer line and eos)."""
    rows = make_rows(2000, 0)
    tokens = [
        9 * rounds * len(program) + 5
        for rounds, _, program in map(parse, (r["prompt"] for r in rows))
    ]
    assert statistics.mean(tokens) >= 150
    assert max(tokens) >= 500
    assert statistics.pstdev(tokens) >= 80
    assert min(tokens) <= 60


def test_splits_are_disjoint_and_seeded(tmp_path):
    train, evals = make_splits(tmp_path, 300, 50, seed=1)
    train_rows, eval_rows = read_rows(train), read_rows(evals)
    assert len(train_rows) == 300 and len(eval_rows) == 50
    assert not {r["prompt"] for r in train_rows} & {r["prompt"] for r in eval_rows}
    assert {r["data_source"] for r in train_rows} == {DATA_SOURCE}
    again = make_splits(tmp_path / "again", 300, 50, seed=1)
    assert again[0].read_bytes() == train.read_bytes()


def test_verifier_reads_the_last_line_only():
    assert grade("1 a:3+4=7\nAnswer: 7", "7").score == 1.0
    assert grade("1 a:3+4=8\nAnswer: 7", "7").acc == 1.0  # the trace is not read
    assert grade("Answer: 7\n1 a:3+4=7", "7").score == -1.0  # answer not last
    assert grade("1 a:3+4=7\nAnswer: 8", "7").pred == "8"
    assert grade("1 a:3+4=7\nAnswer: 7\n", "7").acc == 1.0
    assert grade("", "7").score == -1.0
    assert grade("1 a:3+4=7\nAnswer: seven", "7").score == -1.0
    with pytest.raises(ValueError, match="non-negative integer"):
        grade("Answer: 7", "x")


def test_verifier_is_routed_by_data_source():
    routing = resolve_routing()
    assert routing[DATA_SOURCE] == "long_trace"
    results, stats = score_responses(
        [(DATA_SOURCE, "Answer: 5", "5"), (DATA_SOURCE, "Answer: 6", "5")], routing, timeout_s=5
    )
    assert [r.score for r in results] == [1.0, -1.0] and stats.num_errors == 0
