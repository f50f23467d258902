"""The planner on DeepSeek-V3/GLM-4.5-family presets (issue 43: MLA, shared experts, dense
first layers, MTP) and on rollouts on ranks of their own (issue 42: the split, the rollout
ranks' layout and memory, the step time of each placement). Counts by hand; the model's
arithmetic on small cases; the 32B recipe's split."""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.planning import memory as mp
from vapo_megatron.planning import placement as pl
from vapo_megatron.planning.params import (
    active_param_count,
    attention_numels,
    shard_param_split,
    total_param_count,
)
from vapo_megatron.planning.presets import GPUS, MODEL_PRESETS
from vapo_megatron.planning.vllm import RolloutLayout, kv_bytes_per_token, vllm_weight_bytes
from vapo_megatron.planning.workload import Workload

REPO = Path(__file__).resolve().parents[3]


def preset(name: str) -> HFModelConfig:
    return HFModelConfig.from_hf(MODEL_PRESETS[name])


@pytest.mark.unit
@pytest.mark.parametrize(
    ("name", "total", "without_mtp", "active"),
    [
        # DeepSeek-V3's card: 671B main model + 11.5B of MTP module (its embedding and head
        # shared), 36.6B active with the output head (+0.93B of input embedding here).
        ("deepseek-v3", 682.64, 671.03, 37.55),
        ("kimi-k2", 1026.41, 1026.41, 32.86),  # "1T total, 32B active"
        ("moonlight-16b-a3b", 15.96, 15.96, 2.91),  # "16B total, 3B active"
        ("glm-4.5", 356.79, 352.80, 33.63),  # "355B total, 32B active"
        ("glm-4.5-air", 109.23, 106.85, 13.42),  # "106B total, 12B active" (+1.24B embeddings)
    ],
)
def test_sigmoid_family_presets_have_the_published_sizes(name, total, without_mtp, active):
    hf = preset(name)
    assert total_param_count(hf, head="lm") / 1e9 == pytest.approx(total, abs=0.01)
    assert total_param_count(hf, head="lm", mtp=False) / 1e9 == pytest.approx(without_mtp, abs=0.01)
    assert active_param_count(hf, head="lm") / 1e9 == pytest.approx(active, abs=0.01)


@pytest.mark.unit
def test_mla_shared_experts_dense_layers_and_mtp_by_hand() -> None:
    """DeepSeek-V3 at TP 8 x EP 64: MLA's down-projections column-parallel (local spec), its
    norms whole; layers 0-2 dense, 3-60 MoE with one shared expert; with the MTP layers trained
    (policy.mtp.loss_weight > 0), the MTP layer (an MoE layer, enorm, hnorm, eh_proj, its norm)
    on the last stage; carried as files (the default), none; a critic builds no MTP."""
    hf = preset("deepseek-v3")
    built = shard_param_split(hf, ModelLayout(tp=8, ep=64), head="lm", pp_rank=0)
    layout = ModelLayout(tp=8, ep=64, sequence_parallel=True)
    h = 7168
    q = [1536 // 8 * h, 1536, 128 * 192 // 8 * 1536]
    kv = [576 // 8 * h, 512, 128 * 256 // 8 * 512]
    assert attention_numels(hf, layout) == [*q, *kv, h * (128 * 128 // 8)]
    attention = sum(q) + sum(kv) + h * 128 * 128 // 8
    dense_layer = 2 * h + attention + 3 * 18432 // 8 * h
    moe_layer = 2 * h + attention + 256 * h + 3 * 2048 // 8 * h
    mtp = 2 * h + 2 * h * h // 8 + moe_layer + h
    vocab = hf.padded_vocab_size(8) // 8 * h
    dense, expert = shard_param_split(hf, layout, head="lm", pp_rank=0, mtp=True)
    assert dense == 3 * dense_layer + 58 * moe_layer + mtp + 2 * vocab + h
    assert expert == (58 + 1) * 4 * 3 * 2048 // 8 * h  # 4 local experts, expert TP 8
    critic, critic_expert = shard_param_split(hf, layout, head="value", pp_rank=0, mtp=True)
    assert (critic, critic_expert) == (dense - mtp - vocab + h, 58 * 4 * 3 * 2048 // 8 * h)
    assert built == (dense - mtp, critic_expert)  # MTP carried as files: not built
    # Moonlight: no q compression (one q_proj), two shared experts.
    small = preset("moonlight-16b-a3b")
    assert attention_numels(small, ModelLayout(tp=2))[0] == 16 * 192 // 2 * 2048


@pytest.mark.unit
def test_kv_cache_and_vllm_weights_per_rank() -> None:
    """MLA caches kv_lora_rank + rope per layer whatever the TP; GQA splits its KV heads.
    Data-parallel attention keeps the dense weights over TP and splits the experts over the
    whole replica."""
    assert kv_bytes_per_token(preset("deepseek-v3"), 8) == 61 * (512 + 64) * 2
    assert kv_bytes_per_token(preset("glm-4.5"), 4) == 2 * 92 * 2 * 128 * 2
    hf = preset("qwen3-235b-a22b")
    expert = 94 * 128 * 3 * 1536 * 4096
    dense = total_param_count(hf, head="lm") - expert
    assert vllm_weight_bytes(hf, RolloutLayout(tp=4, dp=16)) == 2 * (dense // 4 + expert // 64)
    assert vllm_weight_bytes(hf, RolloutLayout(tp=8)) == 2 * (dense // 8 + expert // 8)


@pytest.mark.unit
def test_critics_share_the_policys_tokenizer_within_a_family() -> None:
    """Which smaller model of the family can be a critic: only one with the same vocabulary."""
    vocab = {name: preset(name).vocab_size for name in
             ("deepseek-v3", "kimi-k2", "moonlight-16b-a3b", "glm-4.5", "glm-4.5-air")}  # fmt: skip
    assert vocab["moonlight-16b-a3b"] == vocab["kimi-k2"] != vocab["deepseek-v3"]
    assert vocab["glm-4.5-air"] == vocab["glm-4.5"]


def _work(world: int, **kw: object) -> Workload:
    base = dict(world_size=world, prompt_len=2048, response_len=20480, micro_batch_tokens=16384,
                offload="rollout", policy_recompute=("full", "block", 24),
                critic_recompute=("full", "block", 24), gpu_memory_utilization=0.7,
                rollout_tp=4, enforce_eager=False)  # fmt: skip
    return Workload(**{**base, **kw})


@pytest.mark.unit
def test_step_times_follow_the_stated_model() -> None:
    """Training scales as 1 / ranks; the overlapped step is the slower side plus the
    transfer; the synchronous one the sum of its parts; a rollout rank's KV is what its
    weights leave of a budget the held layer and one message are taken from."""
    gpu, hf = GPUS["h100-80gb"], preset("qwen2.5-32b")
    layout = ModelLayout(tp=8, cp=2, sequence_parallel=True)
    models = {"lm": (hf, layout), "value": (hf, layout)}
    work = _work(128)
    half = pl.train_seconds(models, gpu, work, 64)
    assert half == pytest.approx(2 * pl.train_seconds(models, gpu, work, 128))
    sync = pl.colocated_step(mp.plan(hf, gpu, layout, layout, work), models)
    assert sync.step_seconds == pytest.approx(
        sync.decode.seconds + sync.tail_seconds + sync.train_seconds + sync.switch_seconds
    )
    split = pl.separate_step(models, gpu, work, 48)
    assert split is not None and split.trainer.fits and split.trainer_ranks == 80
    assert "rollout" not in split.trainer.phases and split.trainer.kv_cache == 0
    assert split.step_seconds == pytest.approx(
        max(split.train_seconds, split.rollout_seconds) + split.transfer_seconds
    )
    util, kv = pl.rollout_rank_kv(hf, gpu, split.decode.layout, work)
    assert kv == split.decode.kv_cache and util > work.gpu_memory_utilization
    # Without a critic the policy alone trains: about half the FLOPs (no LM head in a critic).
    alone = pl.train_seconds({"lm": (hf, layout)}, gpu, work, 128)
    assert alone == pytest.approx(pl.train_seconds(models, gpu, work, 128) / 2, rel=0.02)


@pytest.mark.unit
def test_best_split_balances_the_two_sides_of_the_32b_recipe() -> None:
    """The 32B recipe on 128 ranks: rollout ranks in whole nodes, the trainer ranks' layout
    searched where the recipe's does not fit fewer ranks, the shortest overlapped step; the
    issue's goal (<= 0.6 of the synchronous step) is not reached by this model (docs say why)."""
    gpu, hf = GPUS["h100-80gb"], preset("qwen2.5-32b")
    layout = ModelLayout(tp=8, cp=2, sequence_parallel=True)
    models = {"lm": (hf, layout), "value": (hf, layout)}
    work = _work(128)
    best = pl.best_split(models, gpu, work, tp_only=True)
    assert best is not None and best.rollout_ranks % 8 == 0
    others = [pl.separate_step(models, gpu, work, r, tp_only=True) for r in range(8, 128, 8)]
    assert all(s is None or s.step_seconds >= best.step_seconds for s in others)
    assert best.wait_seconds < 0.1 * best.step_seconds
    sync = pl.colocated_step(mp.plan(hf, gpu, layout, layout, work), models)
    assert 0.6 < best.step_seconds / sync.step_seconds < 1.0


@pytest.mark.unit
def test_moe_rollout_ranks_take_data_parallel_attention_where_it_pays() -> None:
    """Qwen3-30B-A3B on 32 rollout ranks: experts over the replica leave more KV cache than
    TP alone, and the fastest layout is one of them; TP-only search never proposes it."""
    gpu, hf = GPUS["h100-80gb"], preset("qwen3-30b-a3b")
    work = _work(64, rollout_tp=2, gpu_memory_utilization=0.8)
    tp_only = pl.fastest_rollout(hf, gpu, work, 32, tp_only=True)
    best = pl.fastest_rollout(hf, gpu, work, 32)
    assert tp_only is not None and best is not None and tp_only[0].layout.dp == 1
    assert best[0].layout.dp > 1 and pl.sum_seconds(best) < pl.sum_seconds(tp_only)
    assert best[0].sequences_per_replica > tp_only[0].sequences_per_replica
    one = replace(work, samples_per_step=1)
    assert math.isfinite(pl.fastest_rollout(hf, gpu, one, 8)[0].seconds)


def _plan_tool():
    spec = importlib.util.spec_from_file_location("plan_tool", REPO / "tools" / "plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.unit
@pytest.mark.parametrize(
    ("recipe", "model", "nodes"),
    [("vapo_deepseek_v3.yaml", "deepseek-v3", 128), ("vapo_moonlight_16b_a3b.yaml",
                                                     "moonlight-16b-a3b", 2)],
)  # fmt: skip
def test_family_recipes_fit_with_8_gib_in_every_phase(recipe, model, nodes, capsys) -> None:
    args = ["--recipe", str(REPO / "recipes" / recipe), "--model", model, "--nodes", str(nodes)]
    assert _plan_tool().main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["recipe_fits"] and out["recipe_changes"] == {} and out["headroom_gib"] >= 8, out
    assert out["layout"]["policy"]["ep"] > 1 and out["kv_sequences_per_replica"] >= 8


@pytest.mark.unit
@pytest.mark.parametrize(
    ("recipe", "args", "rollout_ranks"),
    [
        ("vapo_qwen2.5_32b_async.yaml", ["--model", "qwen2.5-32b", "--nodes", "16"], 48),
        ("vapo_qwen2.5_32b_rm7b_async.yaml", ["--model", "qwen2.5-32b", "--critic-model",
                                              "acemath-7b-rm-32k", "--nodes", "16"], 64),
        ("vapo_qwen3_30b_a3b_async.yaml", ["--model", "qwen3-30b-a3b", "--nodes", "8"], 32),
    ],
)  # fmt: skip
def test_separate_recipes_plan_their_own_split(recipe, args, rollout_ranks, capsys) -> None:
    """Each separate recipe's split is the planner's best with vLLM TP replicas, its trainer
    ranks fit with its own layouts, and its step is reported beside the synchronous one."""
    assert _plan_tool().main(["--recipe", str(REPO / "recipes" / recipe), *args]) == 0
    placement = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["placement"]
    mine, best = placement["recipe split"], placement["best split, vLLM TP"]
    assert mine["rollout.ranks"] == best["rollout.ranks"] == rollout_ranks
    assert mine["step_seconds"] == best["step_seconds"] and mine["trainer_peak_gib"] < 71.7
    assert mine["kv_sequences_per_replica"] >= 8 and mine["over_synchronous"] < 1.3
