"""recipes/tiny_glm4_moe_cpu.yaml and tiny_deepseek_cpu.yaml end to end: a tiny GLM-4.5 or
DeepSeek-V3 policy built on first use (the first layer dense, so the engine's routes have a
column without routes), EP 2 on 2 CPU ranks, vLLM-CPU rollouts recording routes, routing
replay in the policy's passes, the critic replaying its scoring pass's routes, token-level
TIS; the expert bias frozen and exported unchanged. ~3-4 minutes each on 2 busy cores:
slow-marked."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.trainer_runs import TRAIN, plain_env, read_metrics
from tests.launcher import REPO_ROOT


def train(recipe: str, tmp_path: Path) -> dict:
    pytest.importorskip("vllm", reason="vllm is not installed (see docs/rollout.md)")
    assets = tmp_path / "assets"
    command = [
        sys.executable, str(TRAIN), str(REPO_ROOT / "recipes" / recipe),
        f"model.path={assets / 'model'}", f"data.train_path={assets / 'train.jsonl'}",
        f"data.eval_path={assets / 'eval.jsonl'}", f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.progress_bar=false", "eval.at_end=false",
    ]  # fmt: skip
    done = subprocess.run(
        command, env=plain_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=1500
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return read_metrics(tmp_path / "run")


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def check_bias_frozen(tmp_path: Path) -> None:
    before = hf_tensors(tmp_path / "assets" / "model")
    after = hf_tensors(tmp_path / "run" / "hf_policy")
    bias = [name for name in before if name.endswith("e_score_correction_bias")]
    assert bias and all(torch.equal(before[name], after[name]) for name in bias)
    trained = [name for name in before if not torch.equal(before[name], after[name])]
    assert len(trained) > len(before) // 2  # the rest did train


@pytest.mark.slow
@pytest.mark.integration
def test_tiny_glm4_moe_recipe_trains_with_routing_replay(tmp_path: Path) -> None:
    metrics = train("tiny_glm4_moe_cpu.yaml", tmp_path)
    assert sorted(metrics) == [1, 2]
    for row in metrics.values():
        assert 0.5 < row["policy/route_agreement"] <= 1.0
        assert row["rollout/logprob_gap"] < 1e-3
        assert 0.5 < row["critic/route_agreement"] <= 1.0
    check_bias_frozen(tmp_path)


@pytest.mark.slow
@pytest.mark.integration
def test_tiny_deepseek_recipe_trains_with_routing_replay(tmp_path: Path) -> None:
    """vLLM-CPU's MLA equals transformers' here with vLLM's torch RoPE
    (rollout/vllm_args.py cpu_rotary_embedding; test_sync_sigmoid_moe.py), so the engine's
    log-probs are the trainer's."""
    metrics = train("tiny_deepseek_cpu.yaml", tmp_path)
    assert sorted(metrics) == [1, 2]
    for row in metrics.values():
        assert 0.5 < row["policy/route_agreement"] <= 1.0
        assert row["rollout/logprob_gap"] < 1e-3
        assert 0.0 < row["policy/rollout_is_weight"] <= 2.0
        assert 0.5 < row["critic/route_agreement"] <= 1.0
    check_bias_frozen(tmp_path)
