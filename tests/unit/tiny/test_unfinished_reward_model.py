"""The reward model with the paper's value bias (issue 44): its training items (finished
responses with the verifier's score, unfinished prefixes with -1, each at its last token), its
build, and the profile tool (tools/reward_profile.py) that reads values along responses."""

from __future__ import annotations

import json
import random
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.launcher import REPO_ROOT
from vapo_megatron.tiny.long_model import UNFINISHED_SCORE, unfinished_examples

sys.path.insert(0, str(REPO_ROOT / "tools"))
import reward_profile  # noqa: E402

pytestmark = pytest.mark.unit


def _samples() -> list[dict]:
    """Graded samples as ``long_model.sample`` returns them: prompt ids 100.., response ids 200.."""
    out = []
    for i, (prompt, response, score) in enumerate([(3, 5, 1.0), (4, 1, -1.0), (2, 40, -1.0)]):
        ids = [100 + k for k in range(prompt)] + [200 + k for k in range(response)]
        out.append({"ids": ids, "prompt_tokens": prompt, "response_tokens": response,
                    "score": score, "acc": float(score > 0), "index": i})  # fmt: skip
    return out


def test_finished_responses_keep_the_score_and_prefixes_are_failures():
    samples = _samples()
    items = unfinished_examples(samples, prefixes_per_response=3, rng=random.Random(0))
    assert len(items) == 3 * (1 + 3) and UNFINISHED_SCORE == -1.0
    for n, s in enumerate(samples):
        finished, *prefixes = items[4 * n : 4 * n + 4]
        assert finished == (s["ids"], s["score"])  # the whole response, the verifier's score
        for ids, target in prefixes:
            assert target == -1.0
            cut = len(ids) - s["prompt_tokens"]  # response tokens kept
            assert 0 <= cut <= s["response_tokens"] - 1  # a state s_0..s_{R-1}: never finished
            assert ids == s["ids"][: len(ids)]
    # Same rng, same cuts; the cuts cover 0..R-1 uniformly.
    again = unfinished_examples(samples, prefixes_per_response=3, rng=random.Random(0))
    assert again == items
    long = samples[2]
    many = unfinished_examples([long], prefixes_per_response=4000, rng=random.Random(1))[1:]
    cuts = [len(ids) - long["prompt_tokens"] for ids, _ in many]
    assert set(cuts) == set(range(40))
    assert abs(sum(cuts) / len(cuts) - 19.5) < 1.0
    assert unfinished_examples(samples, prefixes_per_response=0, rng=random.Random(0)) == [
        (s["ids"], s["score"]) for s in samples
    ]


def test_a_fractional_share_gives_a_prefix_to_that_share_of_responses():
    samples = _samples() * 1000

    def per_response(items: list) -> list[int]:
        """Prefixes after each finished response (the sample's own ids list)."""
        counts = []
        for ids, _ in items:
            if len(counts) < len(samples) and ids is samples[len(counts)]["ids"]:
                counts.append(0)
            else:
                counts[-1] += 1
        return counts

    quarter = per_response(unfinished_examples(samples, prefixes_per_response=0.25,
                                               rng=random.Random(2)))  # fmt: skip
    assert len(quarter) == 3000 and set(quarter) == {0, 1}
    assert sum(quarter) == pytest.approx(750, abs=75)  # 0.25 x 3000, about 3 sd
    more = per_response(unfinished_examples(samples, prefixes_per_response=1.5,
                                            rng=random.Random(2)))  # fmt: skip
    assert set(more) == {1, 2} and sum(more) == pytest.approx(4500, abs=85)


class _PositionModel(torch.nn.Module):
    """A stand-in reward model whose value after token i is i (hidden [1, T, 1] = i, score 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.score = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.ones_(self.score.weight)

    def model(self, input_ids: torch.Tensor) -> SimpleNamespace:
        width = input_ids.shape[1]
        hidden = torch.arange(width, dtype=torch.float32, device="cpu").view(1, width, 1)
        return SimpleNamespace(last_hidden_state=hidden)


def test_profile_reads_the_critics_states_at_the_fractions():
    orm = _PositionModel()
    samples = _samples()
    # V(s_t) is read at the token before response token t: the last prompt token for t = 0.
    values, final = reward_profile.state_values(orm, samples[0]["ids"], 3)
    assert values.tolist() == [2.0, 3.0, 4.0, 5.0, 6.0] and final == 7.0
    fractions = (0.0, 0.25, 0.5, 1.0)
    result = reward_profile.profile(orm, samples, fractions)
    # t = round(f (R - 1)); V(s_t) = prompt_tokens - 1 + t.
    expected = {
        0: [2.0, 3.0, 4.0, 6.0],
        1: [3.0, 3.0, 3.0, 3.0],
        2: [1.0, 1.0 + round(0.25 * 39), 1.0 + round(0.5 * 39), 40.0],
    }
    mean = [sum(expected[i][j] for i in range(3)) / 3 for j in range(4)]
    assert result["all"] == pytest.approx(mean)
    assert result["pass"] == pytest.approx(expected[0])
    assert result["fail"] == pytest.approx(
        [(a + b) / 2 for a, b in zip(expected[1], expected[2], strict=True)]
    )
    assert result["score_after_last"] == pytest.approx((7 + 4 + 41) / 3)
    # The first-token advantage is the textbook GAE loop's (gamma 1, lambda 0.95).
    textbook = []
    for s in samples[1:]:
        v, _ = reward_profile.state_values(orm, s["ids"], s["prompt_tokens"])
        advantage = 0.0
        for t in reversed(range(v.numel())):
            after = v[t + 1].item() if t + 1 < v.numel() else 0.0
            reward = s["score"] if t == v.numel() - 1 else 0.0
            advantage = reward + after - v[t].item() + 0.95 * advantage
        textbook.append(advantage)
    assert result["first_token_advantage_fail"] == pytest.approx(sum(textbook) / 2, rel=1e-6)


def test_table_and_plot(tmp_path):
    orm = _PositionModel()
    fractions = list(reward_profile.PLOT_FRACTIONS)
    result = {
        "prompts": 3, "mean_return": -1 / 3, "fractions": fractions,
        "models": {"a": reward_profile.profile(orm, _samples(), fractions),
                   "b": reward_profile.profile(orm, _samples()[1:], fractions)},
    }  # fmt: skip
    table = reward_profile.markdown(result)
    lines = table.splitlines()
    assert len(lines) == 2 + 2 * 3 and lines[2].startswith("| `a` | all | +2.00 |")
    assert "| `b` | pass | - | - |" in table  # no passing response: no mean
    reward_profile.plot(result, tmp_path / "profile.png")
    assert (tmp_path / "profile.png").read_bytes()[:4] == b"\x89PNG"
    json.dumps(result)  # what --json and the stamp write


@pytest.mark.slow
def test_builds_small_and_a_rerun_does_nothing(tmp_path):
    """make_tiny_long.py --unfinished at toy sizes: the second reward model, its stamp entry and
    both profiles; the same command again reuses them; the first reward model is unchanged."""
    from make_tiny_long import main
    from transformers import AutoModelForSequenceClassification

    argv = [str(tmp_path), "--warmup-steps", "3", "--warmup-problems", "32", "--orm-prompts",
            "4", "--orm-steps", "2", "--n-train", "48", "--n-eval", "2", "--eval-prompts", "2",
            "--unfinished", "--unfinished-steps", "2", "--unfinished-prefixes", "2"]  # fmt: skip
    main(argv)
    stamp = json.loads((tmp_path / "stamp.json").read_text())
    entry = stamp["reward_model_unfinished"]
    assert entry["result"]["orm_prefixes"] == 8 and entry["result"]["orm_samples"] == 4
    assert entry["params"]["model_sha256"] == stamp["result"]["model_sha256"]
    assert set(stamp["reward_profile"]["models"]) == {"reward_model", "reward_model_unfinished"}
    assert entry["command"].endswith("--unfinished-prefixes 2.0 --unfinished-steps 2")
    orm = AutoModelForSequenceClassification.from_pretrained(tmp_path / "reward_model_unfinished")
    assert orm.config.num_labels == 1
    written = (tmp_path / "reward_model_unfinished" / "model.safetensors").stat().st_mtime_ns
    main(argv)
    assert (
        tmp_path / "reward_model_unfinished" / "model.safetensors"
    ).stat().st_mtime_ns == written
    assert json.loads((tmp_path / "stamp.json").read_text()) == stamp
