"""The planner on mixture-of-experts models and on a critic of its own model (issues 27, 28):
counts by hand, the published presets against their model cards, the recipes against the
planner's own search and the 8 GiB of headroom every phase must leave. Against megatron's own
builds: ``test_moe_builds.py``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.planning import host
from vapo_megatron.planning import memory as mp
from vapo_megatron.planning.activations import dispatch_buffer_bytes
from vapo_megatron.planning.params import (
    active_param_count,
    shard_param_count,
    shard_param_split,
)
from vapo_megatron.planning.presets import GPUS, MODEL_PRESETS
from vapo_megatron.planning.workload import GIB, Workload

REPO = Path(__file__).resolve().parents[3]


def preset(name: str) -> HFModelConfig:
    return HFModelConfig.from_hf(MODEL_PRESETS[name])


@pytest.mark.unit
def test_moe_parameters_by_hand() -> None:
    """Qwen3-30B-A3B at TP2 x EP8: per layer the router [128, 2048] and 16 local experts, each
    gate/up [2 x 768 / 2, 2048] and down [2048, 768 / 2]; q/k norms of 128."""
    hf = preset("qwen3-30b-a3b")
    layout = ModelLayout(tp=2, ep=8, sequence_parallel=True)
    dense, expert = shard_param_split(hf, layout, head="lm", pp_rank=0)
    assert expert == 48 * 16 * 3 * 768 // 2 * 2048
    attention = (32 + 2 * 4) * 128 // 2 * 2048 + 2048 * 32 * 128 // 2
    per_layer = 2 * 2048 + attention + 2 * 128 + 128 * 2048
    vocab = hf.padded_vocab_size(2) // 2 * 2048
    assert dense == 48 * per_layer + 2 * vocab + 2048
    # 3.3e9 active of 30.5e9 (the model card), and EP divides only the experts.
    assert active_param_count(hf, head="lm") / 1e9 == pytest.approx(3.35, abs=0.01)
    ep1 = shard_param_split(hf, ModelLayout(tp=2, sequence_parallel=True), head="lm", pp_rank=0)
    assert ep1 == (dense, 8 * expert)
    work = Workload(world_size=32, prompt_len=2048, response_len=20480, micro_batch_tokens=16384)
    state = mp.stage_state(hf, layout, work, head="lm", pp_rank=0)
    # Adam: dense over DP x CP = 16, experts over expert DP = 32 / (2 x 8) = 2.
    assert state.optimizer == -(-dense * 12 // 16) + expert * 12 // 2
    assert dispatch_buffer_bytes(hf, layout, 16384) == 2 * 2 * 8192 * 8 * 2048
    assert dispatch_buffer_bytes(preset("qwen3-32b"), ModelLayout(tp=2), 16384) == 0


@pytest.mark.unit
def test_the_critics_own_model_is_planned_and_its_context_checked() -> None:
    """A 7B critic beside the 32B policy: its own params, its own layout search; AceMath-7B-RM
    as published (4096 positions) cannot score the paper's 22,528-token samples."""
    work = Workload(world_size=128, prompt_len=2048, response_len=20480, micro_batch_tokens=16384,
                    offload="rollout", policy_recompute=("full", "uniform", 1),
                    critic_recompute=("full", "uniform", 1))  # fmt: skip
    gpu, policy = GPUS["h100-80gb"], preset("qwen2.5-32b")
    layout = ModelLayout(tp=8, cp=2, sequence_parallel=True)
    small = ModelLayout(tp=4, cp=2, sequence_parallel=True)  # 28 heads: TP 8 does not divide
    short = mp.plan(policy, gpu, layout, small, work, critic_hf=preset("acemath-7b-rm"))
    assert any("critic: max_position_embeddings=4096" in p for p in short.problems)
    critic = preset("acemath-7b-rm-32k")
    wrong = mp.plan(policy, gpu, layout, layout, work, critic_hf=critic)
    assert wrong.problems[0].startswith("critic: tp=8 must divide num_attention_heads=28")
    pair = mp.plan(policy, gpu, layout, small, work, critic_hf=critic)
    params = shard_param_count(critic, small, head="value", pp_rank=0)
    assert pair.critic_memory.params == 2 * params
    same = mp.plan(policy, gpu, layout, layout, work)
    # 7.1e9 parameters over TP 4 against 32.0e9 over TP 8: 2.2 times fewer per rank.
    assert pair.critic_memory.state < same.critic_memory.state / 2.2
    best = mp.propose(policy, gpu, work, gpus_per_node=8, critic_hf=critic)
    assert best is not None and best.fits and best.headroom >= 8 * GIB
    # Each model's layout from its own size: what recipes/vapo_qwen2.5_32b_rm7b.yaml runs.
    assert (best.policy.tp, best.policy.pp, best.policy.cp) == (4, 1, 1)
    assert (best.critic.tp, best.critic.pp, best.critic.cp) == (4, 2, 1)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("name", "world", "layout", "vllm_tp"),
    [
        ("qwen3-235b-a22b", 256, ModelLayout(tp=4, ep=32, sequence_parallel=True), 8),
        ("qwen3-235b-a22b", 256, ModelLayout(tp=4, ep=32, sequence_parallel=True), 4),
        ("qwen3-30b-a3b", 32, ModelLayout(tp=2, ep=8, sequence_parallel=True), 2),
        ("qwen2.5-32b", 128, ModelLayout(tp=8, cp=2, sequence_parallel=True), 4),
    ],
)
def test_weight_sync_counts_the_module_vllm_holds_while_it_loads(name, world, layout, vllm_tp):
    """vLLM 0.32's layerwise reload keeps every tensor sent to a module until the module is
    complete (``model_loader/reload/layerwise.py::make_online_process_loader``), then
    materializes the module's vLLM shard to load them into. An MoE layer's experts are one
    module: a rank holds all 128 experts' gate, up and down as full HF tensors, whatever
    vLLM's TP (4.5 GiB at 235B-A22B, 1.125 at 30B-A3B), plus their shard over vLLM TP. A dense
    model's largest module is its embedding. Sizes from the published config.json values."""
    config = MODEL_PRESETS[name]
    h = config["hidden_size"]
    if config.get("num_experts"):
        gate = up = config["moe_intermediate_size"] * h  # [moe_intermediate, hidden] each
        down = h * config["moe_intermediate_size"]
        held = config["num_experts"] * (gate + up + down) * 2
        expected_gib = {"qwen3-235b-a22b": 4.5, "qwen3-30b-a3b": 1.125}[name]
        assert held == expected_gib * GIB
    else:
        assert config["vocab_size"] % 128 == 0  # Megatron's padding adds no row at TP 1
        held = config["vocab_size"] * h * 2  # model.embed_tokens.weight, bf16
    work = Workload(world_size=world, prompt_len=2048, response_len=20480,
                    micro_batch_tokens=16384, offload="rollout", rollout_tp=vllm_tp,
                    gpu_memory_utilization=0.8)  # fmt: skip
    result = mp.plan(preset(name), GPUS["h100-80gb"], layout, None, work)
    assert result.phases, result.problems
    # The rest of the sync: the policy's params (the rest is offloaded), vLLM's woken weights,
    # runtime pool and CUDA graphs, one message in flight, the reserve.
    rest = result.policy_memory.params + result.vllm_weights + host.VLLM_RUNTIME_POOL
    rest += host.VLLM_CUDA_GRAPHS + mp.SYNC_BUCKET + sum(result.reserve.values())
    assert result.phases["weight_sync"] - rest == held + -(-held // vllm_tp)


def _plan_tool():
    spec = importlib.util.spec_from_file_location("plan_tool", REPO / "tools" / "plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.unit
@pytest.mark.parametrize(
    ("recipe", "model", "critic", "nodes"),
    [
        ("vapo_qwen3_30b_a3b.yaml", "qwen3-30b-a3b", None, 4),
        ("vapo_qwen3_235b_a22b.yaml", "qwen3-235b-a22b", "qwen3-32b", 32),
        ("vapo_qwen2.5_32b_rm7b.yaml", "qwen2.5-32b", "acemath-7b-rm-32k", 16),
    ],
)
def test_large_recipes_fit_with_8_gib_in_every_phase(recipe, model, critic, nodes, capsys) -> None:
    tool = _plan_tool()
    args = ["--recipe", str(REPO / "recipes" / recipe), "--model", model, "--nodes", str(nodes)]
    args += ["--critic-model", critic] if critic else []
    assert tool.main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["recipe_fits"] and out["headroom_gib"] >= 8, out
    assert out["kv_sequences_per_replica"] >= 8
    if model.startswith("qwen3-") and "a" in model.split("-")[-1]:  # the MoE policies
        assert out["layout"]["policy"]["ep"] > 1


@pytest.mark.unit
def test_plan_tool_names_ep_on_a_dense_model(tmp_path, capsys) -> None:
    """tools/plan.py checks each layout against its model before the expert-group arithmetic:
    an EP on a dense model is refused as that, naming the setting to drop."""
    recipe = (REPO / "recipes" / "vapo_qwen2.5_32b.yaml").read_text()
    bad = tmp_path / "dense_ep.yaml"
    bad.write_text(recipe.replace("base: ", f"base: {REPO / 'recipes'}/", 1) + "\n")
    overrides = tmp_path / "over.yaml"
    overrides.write_text(f"base: {bad}\npolicy:\n  layout: {{tp: 8, cp: 2, ep: 2}}\n")
    tool = _plan_tool()
    args = ["--recipe", str(overrides), "--model", "qwen2.5-32b", "--nodes", "16"]
    assert tool.main(args) != 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "expert parallelism needs a mixture-of-experts model" in out["error"], out
    assert "policy.layout.ep" in out["error"]
