"""tools/ablate_report.py on fake per-seed runs: finals, mean, sd, start, diagnostics, the
table, the JSON, the curves; unfinished runs listed and left out (issue 29)."""

from __future__ import annotations

import json
import statistics
import sys

import pytest

from tests.launcher import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))
from ablate_report import (  # noqa: E402  (tools/ is not a package)
    late_table,
    report,
    shared_movement,
    table,
    write_report,
)

pytestmark = pytest.mark.unit


def fake_run(
    run_dir, *, evals, steps, finished=True, ev=0.1, values=0.5, returns=-0.2, first_value=-0.9
):
    """metrics.jsonl as the trainer writes it (phase, step, metrics), summary.json when finished."""
    run_dir.mkdir(parents=True)
    rows = [{"phase": "critic_pretrain", "step": s, "critic/explained_variance": -0.5}
            for s in (1, 2, 3)]  # fmt: skip
    for step in range(1, steps + 1):
        rows.append({"phase": "train", "step": step, "critic/explained_variance": ev * step,
                     "critic/values_mean": values, "critic/returns_mean": returns,
                     "critic/value_first_token": first_value * (steps - step) / steps,
                     "critic/return_first_token": -0.3,
                     "response_length/mean": 100.0 + step, "policy/clip_frac_high": 0.01,
                     "policy/clip_frac_low": 0.002, "response_length/clip_frac": 0.0})  # fmt: skip
    for step, rate in evals.items():
        rows.append({"phase": "eval", "step": step, "avg@2": rate, "avg@2/stderr": 0.03,
                     "num_prompts": 200})  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if finished:
        (run_dir / "summary.json").write_text(json.dumps({"steps": steps, "seconds": 12.5}))


def test_report_from_fake_seeds(tmp_path):
    out = tmp_path / "sweep"
    finals = {1: 0.40, 2: 0.46, 3: 0.43}
    for seed, final in finals.items():
        fake_run(out / "vapo" / f"seed_{seed}", evals={0: 0.30, 5: 0.35, 10: final}, steps=10)
    fake_run(out / "grpo" / "seed_1", evals={0: 0.30, 10: 0.38}, steps=10, ev=float("nan"))
    fake_run(out / "grpo" / "seed_2", evals={0: 0.30}, steps=4, finished=False)
    rows = report(out, {"vapo": "VAPO", "grpo": "GRPO"})

    vapo = rows["vapo"]
    assert vapo["row"] == "VAPO" and vapo["preset"] == "vapo" and vapo["seeds"] == [1, 2, 3]
    assert vapo["finals"] == [40.0, 46.0, 43.0]
    assert vapo["mean"] == pytest.approx(43.0)
    assert vapo["sd"] == pytest.approx(statistics.stdev([40.0, 46.0, 43.0]), abs=0.01)
    assert vapo["start"] == pytest.approx(30.0) and vapo["steps"] == 10
    assert vapo["critic_pretrain_steps"] == 3 and vapo["paper_aime24"] == 60
    diag = vapo["diagnostics"]
    # Fifths of 10 steps: steps 1-2 and 9-10.
    assert diag["explained_variance"] == {"first_fifth": pytest.approx(0.15),
                                          "last_fifth": pytest.approx(0.95)}  # fmt: skip
    assert diag["value_bias"]["first_fifth"] == pytest.approx(0.7)
    # V0 - R0: -0.9 * (10 - step) / 10 + 0.3; steps 1-2 -> -0.465, steps 9-10 -> 0.255.
    assert diag["first_token_bias"] == {"first_fifth": pytest.approx(-0.465),
                                        "last_fifth": pytest.approx(0.255)}  # fmt: skip
    assert diag["response_length"]["last_fifth"] == pytest.approx(109.5)
    assert vapo["curves"]["2"] == {"0": 30.0, "5": 35.0, "10": 46.0}

    grpo = rows["grpo"]
    assert grpo["seeds"] == [1] and grpo["unfinished"] == [2] and grpo["sd"] is None
    assert "explained_variance" not in grpo["diagnostics"]  # NaN (no critic) is left out

    text = table(rows)
    assert (
        "| VAPO | `vapo` | 43.0 ± 3.0 | 3 | 30.0 | 10 + 3 critic | 0.15 -> 0.95 | 0.70 -> 0.70 "
        "| -0.47 -> 0.26 | 102 -> 110 |" in text
    )
    assert "| GRPO | `grpo` | 38.0 | 1 |" in text


def test_write_report_files(tmp_path):
    out = tmp_path / "sweep"
    fake_run(out / "ppo" / "seed_1", evals={0: 0.3, 4: 0.2}, steps=4)
    json_path, png_path = tmp_path / "ablation.json", tmp_path / "curves.png"
    write_report(out, {"ppo": "Vanilla PPO"}, json_path=json_path, png_path=png_path,
                 meta={"recipe": "recipes/ablation_long.yaml"})  # fmt: skip
    document = json.loads(json_path.read_text())
    assert document["recipe"] == "recipes/ablation_long.yaml"
    row = document["rows"]["ppo"]
    assert (row["row"], row["finals"], row["mean"], row["start"], row["steps"]) == (
        "Vanilla PPO",
        [20.0],
        20.0,
        30.0,
        4,
    )
    assert json.loads((out / "report.json").read_text()) == document
    assert (out / "report.md").read_text().startswith("| run |")
    assert png_path.stat().st_size > 1000


def test_late_means_and_paired_differences(tmp_path):
    """The late mean averages the evaluations past half the steps; each row is compared with
    VAPO seed by seed over the seeds both finished, with Student's t interval."""
    out = tmp_path / "sweep"
    curves = {
        ("vapo", 1): {0: 0.3, 4: 0.9, 6: 0.4, 8: 0.5, 10: 0.6},  # late: 50 (step 4 is not late)
        ("vapo", 2): {0: 0.3, 6: 0.3, 8: 0.3, 10: 0.3},  # 30
        ("vapo", 3): {0: 0.3, 10: 0.2},  # 20; no ppo seed 3 to pair it with
        ("ppo", 1): {0: 0.3, 6: 0.5, 8: 0.6, 10: 0.7},  # 60: +10
        ("ppo", 2): {0: 0.3, 6: 0.36, 8: 0.36, 10: 0.36},  # 36: +6
        ("grpo", 1): {0: 0.3, 10: 0.5},  # one common seed: no interval
    }
    for (row, seed), evals in curves.items():
        fake_run(out / row / f"seed_{seed}", evals=evals, steps=10)
    fake_run(out / "ppo" / "seed_4", evals={0: 0.3}, steps=3, finished=False)
    rows = report(out, {"vapo": "VAPO", "ppo": "Vanilla PPO", "grpo": "GRPO"})

    assert rows["vapo"]["late"]["finals"] == [50.0, 30.0, 20.0]
    assert rows["vapo"]["late"]["mean"] == pytest.approx(100 / 3, abs=0.01)
    assert "paired" not in rows["vapo"] and "paired" not in rows["grpo"]
    ppo = rows["ppo"]
    assert ppo["late"]["finals"] == [60.0, 36.0]
    half = 12.706 * statistics.stdev([10.0, 6.0]) / 2**0.5
    assert ppo["paired"] == {
        "reference": "vapo", "seeds": 2, "mean": 8.0,
        "sd": pytest.approx(statistics.stdev([10.0, 6.0]), abs=0.01),
        "ci95": [pytest.approx(8.0 - half, abs=0.01), pytest.approx(8.0 + half, abs=0.01)],
    }  # fmt: skip
    # Late slopes, points per 10 steps: seed 1 rises 5 points a step of 2 (50), seed 2 is
    # flat (0), seed 3 has one late evaluation (none).
    slope = rows["vapo"]["late"]["slope"]
    assert (slope["seeds"], slope["mean"]) == (2, pytest.approx(25.0))
    assert slope["ci95"][0] < 0 < slope["ci95"][1]
    assert rows["grpo"]["late"]["slope"] is None
    text = late_table(rows)
    assert (
        "| VAPO | 33.3 ± 15.3 | 50.0, 30.0, 20.0 | - | - | +25.0 ± 35.4 | -292.6 to +342.6 |"
        in text
    )
    assert (
        "| Vanilla PPO | 48.0 ± 17.0 | 60.0, 36.0 | +8.0 ± 2.8 | -17.4 to +33.4 | +25.0 ± 35.4 |"
        in text
    )
    assert "| GRPO | 50.0 | 50.0 | - | - | - | - |" in text


@pytest.mark.parametrize(
    "second, fraction",
    [
        ({0: 5.0, 1: 20.0, 2: 24.0, 3: 20.0, 4: 24.0}, 1.0),  # the same ups and downs
        ({0: 5.0, 1: 24.0, 2: 20.0, 3: 24.0, 4: 20.0}, 0.0),  # opposite ones
    ],
)
def test_shared_movement_of_the_evaluations(second, fraction):
    """Residuals about each run's own line, shared across rows at each (seed, step); the
    start (step 0) and runs of fewer than 3 evaluations are left out."""
    first = {"0": 99.0, "1": 10.0, "2": 14.0, "3": 10.0, "4": 14.0}
    rows = {
        "vapo": {"curves": {"1": first, "2": {"0": 1.0, "5": 3.0}}},
        "ppo": {"curves": {"1": {str(k): v for k, v in second.items()}}},
    }
    assert shared_movement(rows) == {"fraction": fraction, "rows": 2, "independent": 0.5}
    assert shared_movement({"vapo": {"curves": {"1": {"0": 1.0, "5": 2.0}}}}) is None
