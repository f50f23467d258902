"""The planner's MoE counts against megatron's own builds (issues 27, 28): ``vapo-train
--dry-run`` builds tiny Qwen3-MoE models on ``meta`` at world 8 with the trainer's groups (the
expert ones included), DDP and distributed optimizer (``planning/dry_run.py``), and sets the
planner's figures (``planning/params.py``, ``planning/memory.py``) beside the built ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.planning.params import shard_param_split

REPO = Path(__file__).resolve().parents[3]
TINY = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 250,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}  # fmt: skip
TINY_CRITIC = {**TINY, "architectures": ["Qwen3MoeForSequenceClassification"],
               "hidden_size": 48, "num_experts": 4}  # fmt: skip
"""A critic of its own model: narrower than the policy, fewer experts; head_dim 16 x 4 heads =
64 wide queries against hidden 48."""


def dry_run(tmp_path: Path, *overrides: str) -> dict:
    """``vapo-train tiny_cpu.yaml --dry-run`` of the tiny MoE policy at world 8, ranks 0 and 7
    (bf16, distributed optimizer for both models); its JSON summary."""
    policy = tmp_path / "policy" / "config.json"
    policy.parent.mkdir(exist_ok=True)
    policy.write_text(json.dumps(TINY))
    base = ["model.dtype=bfloat16", "policy.optim.distributed_optimizer=true",
            "critic.optim.distributed_optimizer=true"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(REPO / "vapo_megatron" / "train.py"),
         str(REPO / "recipes" / "tiny_cpu.yaml"), "--dry-run", "--world-size", "8",
         "--ranks", "0,7", "--model", str(policy), *base, *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_against_build(report: dict, role: str, hf: HFModelConfig, layout: ModelLayout) -> None:
    """Parameters exact; grads and Adam within the distributed optimizer's padding (each DDP
    bucket to a multiple of lcm(DP, 128) elements, each parameter's start to 64), and far
    from what Adam would be with the experts sharded over DP x CP instead of expert DP."""
    model = report[role]
    assert model["param_count"] == model["planned_param_count"], (role, model)
    built, planned = model["built_bytes"], model["planned_bytes"]
    assert built["params"] == planned["params"], (role, built, planned)
    for key in ("grads", "optimizer"):
        assert abs(built[key] - planned[key]) <= 0.03 * planned[key], (role, key, built, planned)
    pp_rank = model["coords"]["pp"]
    dense, expert = shard_param_split(hf, layout, head=model_head(role), pp_rank=pp_rank)
    if expert:
        dp_cp = 8 // (layout.tp * layout.pp)
        wrong = (dense + expert) * 12 / dp_cp  # bf16: fp32 main copy and two moments
        assert abs(built["optimizer"] - wrong) > 5 * abs(built["optimizer"] - planned["optimizer"])


def model_head(role: str) -> str:
    return "lm" if role == "policy" else "value"


@pytest.mark.unit
@pytest.mark.timeout(300)
def test_moe_counts_equal_meta_builds(tmp_path: Path) -> None:
    """Policy TP2 x PP2 x EP2 (sequence parallel); critic a narrower MoE of its own
    (critic.model: its config.json) at TP2 with expert TP 1 x EP4."""
    critic_dir = tmp_path / "critic"
    critic_dir.mkdir()
    (critic_dir / "config.json").write_text(json.dumps(TINY_CRITIC))
    summary = dry_run(
        tmp_path, "policy.layout.tp=2", "policy.layout.pp=2", "policy.layout.ep=2",
        "policy.layout.sequence_parallel=true", f"critic.model={critic_dir}",
        "algorithm.critic_init=reward_model", "critic.layout.tp=2", "critic.layout.etp=1",
        "critic.layout.ep=4", "critic.layout.sequence_parallel=true",
    )  # fmt: skip
    policy = ModelLayout(tp=2, pp=2, ep=2, sequence_parallel=True)
    critic = ModelLayout(tp=2, ep=4, etp=1, sequence_parallel=True)
    for report in summary["ranks"]:
        check_against_build(report, "policy", HFModelConfig.from_hf(TINY), policy)
        check_against_build(report, "critic", HFModelConfig.from_hf(TINY_CRITIC), critic)
        assert report["policy"]["layout"] == {"tp": 2, "pp": 2, "cp": 1, "dp": 2, "ep": 2,
                                              "etp": 2, "edp": 1}  # fmt: skip
        assert report["critic"]["layout"]["edp"] == 2  # 8 ranks / (etp 1 x ep 4)
    last = summary["ranks"][1]
    assert last["policy"]["groups"]["ep"] == [5, 7]
    assert last["critic"]["groups"]["ep"] == [4, 5, 6, 7]
