"""Generation k steps behind and rollout ranks of their own (issue 42), end to end on CPU.

Default run: recipes/tiny_cpu_async.yaml's separate placement (2 trainer ranks, 1 rollout
rank, lag 1) trains, with a checkpoint (the batch in flight flushed into it), evaluation on
the rollout rank, stale batches corrected by V-trace GAE; and the colocated lag on 2 ranks.
Slow: kill -9 resume in the separate placement, the tiny MoE recipe (routing replay) and the
small-critic recipe in it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.trainer_runs import TRAIN, make_assets, plain_env, read_metrics, run_trainer
from tests.launcher import REPO_ROOT

pytestmark = pytest.mark.integration
ASYNC = REPO_ROOT / "recipes" / "tiny_cpu_async.yaml"
SEPARATE = ("rollout.placement=separate", "rollout.ranks=1", "trainer.local_world_size=3")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("tiny"))


def run_recipe(recipe: Path, run_dir: Path, *overrides: str, timeout: float = 900) -> None:
    command = [sys.executable, str(TRAIN), str(recipe), f"trainer.run_dir={run_dir}",
               "trainer.progress_bar=false", *overrides]  # fmt: skip
    done = subprocess.run(
        command, env=plain_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


def check_stale_steps(metrics: dict[int, dict], lag: int) -> None:
    for step, row in metrics.items():
        staleness = min(step - 1, lag)
        assert row["rollout/staleness"] == staleness, (step, row["rollout/staleness"])
        if staleness:  # V-trace GAE ran on the stale batch, whose ratios moved
            assert row["offpolicy/stale_token_frac"] == 1.0
            assert 0.5 < row["offpolicy/ratio_mean"] < 2.0
            assert 0.0 < row["offpolicy/ratio_mean_abs_log"]
        else:
            assert not any(k.startswith("offpolicy/") for k in row), row


@pytest.mark.timeout(900)
def test_the_separate_placement_trains_with_stale_batches_corrected(tmp_path, assets):
    args = [f"{k}={v}" for k, v in assets.items()]
    run_recipe(
        ASYNC, tmp_path, *args, "trainer.steps=3", "trainer.checkpoint_every=2",
        "algorithm.value_pretrain_steps=1", "critic_pretrain.min_steps=1",
        "trainer.export_hf=false",
    )  # fmt: skip
    metrics = read_metrics(tmp_path)
    assert sorted(metrics) == [1, 2, 3]
    check_stale_steps(metrics, lag=1)
    for row in metrics.values():
        assert row["time/trainer_wait"] >= 0 and row["time/rollout_wait"] >= 0
        assert row["sync/buckets"] >= 1  # the update's weights went to the rollout rank
    assert "critic/explained_variance" in metrics[3]
    assert read_metrics(tmp_path, "critic_pretrain")  # pretraining batches came from it too
    evals = read_metrics(tmp_path, "eval")
    assert 3 in evals and evals[3]["num_prompts"] > 0  # evaluated on the rollout rank
    # The checkpoint after step 2 holds the batch made for step 3 (in flight, not lost).
    extra = list((tmp_path / "checkpoints").glob("step_*/extra.pt"))
    import torch

    queued = {len(torch.load(p, weights_only=False)["rollout_queue"] or []) for p in extra}
    assert 1 in queued, queued


@pytest.mark.timeout(600)
def test_the_colocated_lag_keeps_the_schedule(tmp_path, assets):
    run_trainer(
        tmp_path, assets, 2, "rollout.lag=2", "trainer.steps=3", "algorithm.value_pretrain_steps=0",
        "trainer.checkpoint_every=0", "eval.at_end=false", "trainer.export_hf=false", timeout=540,
    )  # fmt: skip
    metrics = read_metrics(tmp_path)
    check_stale_steps(metrics, lag=2)
    made = [metrics[s]["rollout/batches_made"] for s in (1, 2, 3)]
    assert made == [3.0, 0.0, 0.0], made  # batches 1-3 all made at step 1 (version 0)


@pytest.mark.slow  # ~5 minutes on 2 busy cores: three starts of a 3-rank run
@pytest.mark.timeout(1500)
def test_kill_resume_is_exact_in_the_separate_placement(tmp_path, assets):
    overrides = [*(f"{k}={v}" for k, v in assets.items()), *SEPARATE, "rollout.lag=1"]
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "kill_resume.py"), str(tmp_path),
         "--kills", "published:3,random", "--steps", "4", "--", *overrides],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=1400,
    )  # fmt: skip
    log = f"stdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-3000:]}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ok"] and summary["differences"] == 0 and summary["failed_starts"] == 0, log
    assert summary["compared_rows"] == 7, log  # 3 critic-pretraining and 4 VAPO steps


@pytest.mark.slow  # ~4 minutes each on 2 busy cores
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("recipe", ["tiny_moe_cpu.yaml", "tiny_cpu_small_critic.yaml"])
def test_other_tiny_recipes_train_in_the_separate_placement(tmp_path, recipe):
    pytest.importorskip("vllm", reason="vllm is not installed (see docs/rollout.md)")
    assets = tmp_path / "assets"
    overrides = [*SEPARATE, "trainer.steps=3", "eval.at_end=false", "trainer.export_hf=false"]
    if recipe == "tiny_moe_cpu.yaml":  # its own tiny MoE model and task
        overrides += [f"model.path={assets / 'model'}", f"data.train_path={assets / 'train.jsonl'}",
                      f"data.eval_path={assets / 'eval.jsonl'}"]  # fmt: skip
    run_recipe(REPO_ROOT / "recipes" / recipe, tmp_path / "run", *overrides, timeout=1400)
    metrics = read_metrics(tmp_path / "run")
    check_stale_steps(metrics, lag=1)
    if recipe == "tiny_moe_cpu.yaml":  # the engine's routes reached the policy's passes
        for row in metrics.values():
            assert 0.5 < row["policy/route_agreement"] <= 1.0
