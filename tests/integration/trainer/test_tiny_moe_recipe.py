"""recipes/tiny_moe_cpu.yaml end to end: a tiny Qwen3-MoE policy built on first use, EP 2 on
2 CPU ranks, vLLM-CPU rollouts recording routes, routing replay in the policy's passes and
token-level TIS. ~4 minutes on 2 busy cores (building the task and model, two engines,
two critic-pretraining and two VAPO steps): slow-marked."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.trainer_runs import TRAIN, plain_env, read_metrics
from tests.launcher import REPO_ROOT


@pytest.mark.slow
@pytest.mark.integration
def test_tiny_moe_recipe_trains_with_routing_replay(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vllm is not installed (see docs/rollout.md)")
    assets = tmp_path / "assets"
    command = [
        sys.executable, str(TRAIN),
        str(REPO_ROOT / "recipes" / "tiny_moe_cpu.yaml"),
        f"model.path={assets / 'model'}", f"data.train_path={assets / 'train.jsonl'}",
        f"data.eval_path={assets / 'eval.jsonl'}", f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.progress_bar=false", "eval.at_end=false",
    ]  # fmt: skip
    done = subprocess.run(
        command, env=plain_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=1500
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    metrics = read_metrics(tmp_path / "run")
    assert sorted(metrics) == [1, 2]
    for row in metrics.values():
        # The engine's routes reached the policy: most of them are the trainer's own choice
        # (same weights at the scoring pass), and the log-probs agree under replay.
        assert 0.5 < row["policy/route_agreement"] <= 1.0
        assert row["rollout/logprob_gap"] < 1e-3
        assert 0.0 < row["policy/rollout_is_weight"] <= 2.0
        # The MoE critic replays its scoring pass's routes in its updates (critic.routing_replay:
        # scoring): its own top-k, compared there, mostly agrees (the router moves little).
        assert 0.5 < row["critic/route_agreement"] <= 1.0
