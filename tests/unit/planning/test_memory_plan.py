"""The planner's model (vapo_megatron/planning/memory.py).

Parameter counts are checked against megatron-core models built on CPU in two gloo ranks (this
file is also the worker: ``python test_memory_plan.py OUT_DIR``); the rest against the
published sizes and the two anchors of the issue (the paper layout fits on 16 x 8 H100, 32B on
one 80 GB GPU does not).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.models.logprobs import LOGPROB_CHUNK_TOKENS
from vapo_megatron.planning import host
from vapo_megatron.planning import memory as mp
from vapo_megatron.planning.params import shard_param_count, total_param_count
from vapo_megatron.planning.plan_report import format_plan, plan_summary
from vapo_megatron.planning.presets import GPUS, MODEL_PRESETS
from vapo_megatron.planning.workload import FULL_RECOMPUTE, GIB, Workload

REPO = Path(__file__).resolve().parents[3]

SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
         "num_attention_heads": 4, "vocab_size": 250, "max_position_embeddings": 512,
         "rms_norm_eps": 1e-6}  # fmt: skip
CONFIGS = {
    "qwen2": {"model_type": "qwen2", "num_key_value_heads": 2, **SMALL},
    "qwen2-tied-1kv": {
        "model_type": "qwen2",
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
        **SMALL,
    },  # fmt: skip
    "llama": {"model_type": "llama", "num_key_value_heads": 2, **SMALL},
}
# (tp, pp, vpp) on 2 ranks; data parallelism takes the rest.
LAYOUTS = [(2, 1, None), (1, 2, None), (1, 2, 2)]


def hf(name: str) -> HFModelConfig:
    return HFModelConfig.from_hf(CONFIGS[name] if name in CONFIGS else MODEL_PRESETS[name])


def worker(out_dir: str) -> None:
    """Build every config x layout x head on this rank; write the parameter counts."""
    from vapo_megatron.models.provider import build_model, transformer_config
    from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu

    rows = []
    for tp, pp, vpp in LAYOUTS:
        groups = initialize_megatron_cpu(tp=tp, pp=pp, vpp=vpp)
        layout = ModelLayout(tp=tp, pp=pp, vpp=vpp, sequence_parallel=tp > 1)
        for name in CONFIGS:
            for head in ("lm", "value"):
                chunks = build_model(hf(name), transformer_config(hf(name), layout), head=head)
                params = {id(p): p.numel() for c in chunks for p in c.parameters()}
                rows.append({"config": name, "tp": tp, "pp": pp, "vpp": vpp, "head": head,
                             "pp_rank": groups.rank(groups.pp), "count": sum(params.values())})  # fmt: skip
    rank = int(os.environ["RANK"])
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rows))
    destroy()


@pytest.mark.distributed
def test_shard_counts_equal_megatron_builds(tmp_path: Path) -> None:
    from tests.launcher import run_workers

    run_workers(__file__, 2, str(tmp_path), timeout=300)
    rows = [r for rank in (0, 1) for r in json.loads((tmp_path / f"rank{rank}.json").read_text())]
    assert len(rows) == 2 * len(LAYOUTS) * len(CONFIGS) * 2
    for row in rows:
        layout = ModelLayout(tp=row["tp"], pp=row["pp"], vpp=row["vpp"])
        want = shard_param_count(hf(row["config"]), layout, head=row["head"],
                                    pp_rank=row["pp_rank"])  # fmt: skip
        assert want == row["count"], row


@pytest.mark.unit
@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("qwen2.5-7b", 7.62),
        ("qwen2.5-32b", 32.76),
        ("qwen2.5-72b", 72.71),
        ("llama-3.1-70b", 70.55),
        ("acemath-7b-rm", 7.62),  # Qwen2.5-Math-7B's shapes
        ("qwen3-32b", 32.76),  # the model card: 32.8B
        ("qwen3-30b-a3b", 30.53),  # 30.5B
        ("qwen3-235b-a22b", 235.09),  # 235B
    ],
)
def test_presets_have_the_published_sizes(name: str, billions: float) -> None:
    assert total_param_count(hf(name), head="lm") / 1e9 == pytest.approx(billions, abs=0.01)


def paper_workload(**kw) -> Workload:
    base = dict(world_size=128, prompt_len=2048, response_len=20480, micro_batch_tokens=16384,
                rollout_tp=4, gpu_memory_utilization=0.6)  # fmt: skip
    return Workload(**{**base, **kw})


PAPER = ModelLayout(tp=8, cp=2, sequence_parallel=True)
BLOCK_24 = ("full", "block", 24)


@pytest.mark.unit
def test_paper_layout_needs_offload_and_recompute_for_vllm_at_0_6() -> None:
    gpu, model = GPUS["h100-80gb"], hf("qwen2.5-32b")
    resident = mp.plan(model, gpu, PAPER, PAPER, paper_workload())
    # vLLM's 0.6 share beside two resident 32B training states is too much, and the update
    # leaves less than the 8 GiB of headroom wanted: no share of vLLM's fixes that.
    assert not resident.fits and any("rollout" in p for p in resident.problems)
    assert any("policy_update" in p for p in resident.problems)
    offloaded = paper_workload(offload="rollout", policy_recompute=BLOCK_24,
                               critic_recompute=BLOCK_24, gpu_memory_utilization=0.7)  # fmt: skip
    fitted = mp.plan(model, gpu, PAPER, PAPER, offloaded)
    assert fitted.fits and fitted.headroom >= 8 * GIB
    assert all(gpu.memory_bytes - need >= 8 * GIB for need in fitted.phases.values())
    assert fitted.phases["rollout"] < resident.phases["rollout"] - 40 * GIB
    assert fitted.concurrent_sequences > 20 and fitted.rollout_seconds < resident.rollout_seconds
    pinned = fitted.pinned["training_state"]  # grads are dropped, not copied
    assert pinned.label == "exact" and pinned.nbytes == sum(
        m.params + m.optimizer for m in (fitted.policy_memory, fitted.critic_memory)
    )
    assert mp.max_vllm_utilization(model, gpu, PAPER, PAPER, offloaded) >= 0.8
    # Distributed optimizer: Adam over DP x CP = 16 ranks; no sharding is 16x as large.
    plain = mp.plan(model, gpu, PAPER, PAPER, paper_workload(distributed_optimizer=False))
    assert plain.policy_memory.optimizer == pytest.approx(16 * fitted.policy_memory.optimizer, 1e-6)


@pytest.mark.unit
def test_search_proposes_the_paper_layout_with_offload() -> None:
    work = paper_workload(offload="rollout", policy_recompute=BLOCK_24, critic_recompute=BLOCK_24)
    best = mp.propose(hf("qwen2.5-32b"), GPUS["h100-80gb"], work, gpus_per_node=8)
    assert best is not None and best.fits and best.headroom >= 8 * GIB
    assert (best.policy.tp, best.policy.pp, best.policy.cp) == (8, 1, 2)
    assert best.workload.gpu_memory_utilization >= 0.6


@pytest.mark.unit
def test_32b_on_one_gpu_does_not_fit() -> None:
    work = paper_workload(world_size=1, rollout_tp=1)
    assert mp.propose(hf("qwen2.5-32b"), GPUS["h100-80gb"], work, gpus_per_node=1) is None
    one = mp.plan(hf("qwen2.5-32b"), GPUS["h100-80gb"], ModelLayout(), ModelLayout(), work)
    assert not one.fits and one.peak > 10 * GIB * 80
    # No room for one sequence of KV cache: the summary and the table say so, not crash.
    assert one.kv_cache <= 0 or one.concurrent_sequences < 1
    assert plan_summary(one)["rollout_seconds_estimated"] is None
    assert "never: the KV cache holds less than one sequence" in format_plan(one, "32B x 1")


@pytest.mark.unit
def test_layouts_that_do_not_divide_are_flagged() -> None:
    model = hf("qwen2.5-32b")
    bad_tp = mp.plan(model, GPUS["h100-80gb"], ModelLayout(tp=16), None, paper_workload())
    assert any("num_attention_heads=40" in p for p in bad_tp.problems)
    bad_world = mp.plan(model, GPUS["h100-80gb"], ModelLayout(tp=8, cp=2), None,
                        paper_workload(world_size=24))  # fmt: skip
    assert any("does not divide" in p for p in bad_world.problems)
    assert mp.rollout_tp_problems(model, 3, 24)  # 40 heads over 3 ranks


@pytest.mark.unit
def test_what_the_trainer_keeps_is_counted() -> None:
    model, gpu = hf("qwen2.5-32b"), GPUS["h100-80gb"]
    base = mp.plan(model, gpu, PAPER, PAPER, paper_workload(gpu_memory_utilization=0.3))
    work = base.workload
    act = lambda **kw: mp.plan(model, gpu, PAPER, PAPER, replace(work, **kw)).policy_memory  # noqa: E731
    full = act(policy_recompute=FULL_RECOMPUTE).activations
    block = act(policy_recompute=BLOCK_24).activations
    selective = act(policy_recompute=("selective", None, None)).activations
    assert full < block < base.policy_memory.activations == selective  # no s^2 term counted
    assert full < base.policy_memory.activations / 5
    assert act(critic_recompute=FULL_RECOMPUTE).activations == base.policy_memory.activations
    # Logits as implemented: 4 B per element (bf16 kept + bf16 grad) plus one fp32 chunk.
    tokens = math.ceil(max(work.micro_batch_tokens, work.sequence_len) / 2)  # over CP 2
    vocab_local = model.padded_vocab_size(8) // 8
    logits = base.policy_memory.activations - base.critic_memory.activations  # same layers
    chunk = min(tokens, LOGPROB_CHUNK_TOKENS)
    assert logits == pytest.approx(tokens * vocab_local * 4 + chunk * vocab_local * 16, abs=2)
    # grad_reduce_in_fp32 off: 2-byte grads.
    assert act(grad_reduce_in_fp32=False).grads * 2 == base.policy_memory.grads
    # Offload during rollout: the rollout holds no training state, the sync only the policy's
    # parameters; the updates are unchanged.
    off = mp.plan(model, gpu, PAPER, PAPER, replace(work, offload="rollout"))
    reserve = sum(off.reserve.values())
    assert off.phases["rollout"] == int(0.3 * gpu.memory_bytes) + reserve
    assert off.phases["weight_sync"] < base.phases["weight_sync"] - 30 * GIB
    assert off.phases["policy_update"] == base.phases["policy_update"]
    # CUDA graphs come out of vLLM's budget; eager mode leaves them to the KV cache.
    eager = mp.plan(model, gpu, PAPER, PAPER, replace(work, enforce_eager=True))
    assert eager.kv_cache - base.kv_cache == host.VLLM_CUDA_GRAPHS
    summary = plan_summary(base)
    assert summary["layout"]["policy"]["dp"] == 8 and summary["layout"]["rollout_tp"] == 4
    assert summary["headroom_gib"] == round(base.headroom / GIB, 2)
    json.dumps(summary)  # the CLI's last line


@pytest.mark.unit
def test_pinned_blocks_round_up_to_powers_of_two() -> None:
    assert [host.pinned_block(n) for n in (0, 1, 3, 4, 5, 3 << 30)] == [0, 1, 4, 4, 8, 4 << 30]
    assert host.pinned_rounding([3, 4]) == 8 / 7


@pytest.mark.unit
def test_pinned_host_memory_counts_every_part() -> None:
    """Every pinned byte a GPU's rank holds, labelled: the offloaded training state (exact, no
    grads), megatron's checkpoint staging and vLLM's sleep backups (estimated); per node too."""
    model, gpu = hf("qwen2.5-32b"), GPUS["h100-80gb"]
    work = paper_workload(offload="rollout", policy_recompute=BLOCK_24,
                          critic_recompute=BLOCK_24, gpu_memory_utilization=0.7)  # fmt: skip
    base = mp.plan(model, gpu, PAPER, PAPER, work)
    parts = base.pinned
    assert list(parts) == ["training_state", "checkpoint_staging", "vllm_cuda_graphs",
                           "vllm_runtime"]  # fmt: skip
    assert {name: p.label for name, p in parts.items()} == {
        "training_state": "exact", "checkpoint_staging": "estimated",
        "vllm_cuda_graphs": "estimated", "vllm_runtime": "estimated",
    }  # fmt: skip
    models = (base.policy_memory, base.critic_memory)
    assert parts["training_state"].nbytes == sum(m.params + m.optimizer for m in models)
    assert base.host_bytes == sum(p.nbytes for p in parts.values())
    assert base.host_bytes_per_node == 8 * base.host_bytes
    assert 25 * GIB < base.host_bytes < 35 * GIB  # was "51 GiB [exact]" with grads
    # Staging: each model's per-rank checkpoint share, power-of-two rounded (1 to 2x); a sync
    # save reuses the blocks model after model, an async one stages both at once.
    shares = [host.checkpoint_bytes(model, PAPER, work, head=h, pp_rank=0) for h in ("lm", "value")]
    sync = parts["checkpoint_staging"].nbytes
    assert max(shares) < sync < 2 * max(shares)
    async_ = mp.plan(model, gpu, PAPER, PAPER, replace(work, checkpoint_async=True))
    assert sum(shares) < async_.pinned["checkpoint_staging"].nbytes < 2 * sum(shares)
    # vLLM: level 1 backs up its weight shard; eager mode has no graph pool to back up.
    level1 = mp.plan(model, gpu, PAPER, PAPER, replace(work, sleep_level=1)).pinned
    assert base.vllm_weights < level1["vllm_weights"].nbytes < 2 * base.vllm_weights
    eager = mp.plan(model, gpu, PAPER, PAPER, replace(work, enforce_eager=True))
    assert "vllm_cuda_graphs" not in eager.pinned
    # The weights' wake brings the graph pool back: the sync holds it, the updates do not.
    assert base.phases["weight_sync"] - eager.phases["weight_sync"] == host.VLLM_CUDA_GRAPHS
    assert base.phases["policy_update"] == eager.phases["policy_update"]
    resident = mp.plan(model, gpu, PAPER, PAPER, replace(work, offload="none"))
    assert "training_state" not in resident.pinned
    table = format_plan(base, "32B")
    assert "per 8-GPU node" in table
    assert all(f"[{p.label}] {p.what}" in table for p in parts.values())
    summary = plan_summary(base)
    assert summary["pinned_gib_per_gpu"]["training_state"]["label"] == "exact"
    assert summary["host_gib_per_node"] == round(base.host_bytes_per_node / GIB, 1)


def _plan_tool():
    spec = importlib.util.spec_from_file_location("plan_tool", REPO / "tools" / "plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.unit
@pytest.mark.parametrize(
    ("recipe", "model", "nodes"),
    [("vapo_qwen2.5_32b.yaml", "qwen2.5-32b", 16), ("vapo_qwen2.5_7b.yaml", "qwen2.5-7b", 1)],
)
def test_recipes_fit_with_headroom_and_vllm_at_0_6(recipe, model, nodes, capsys) -> None:
    """The recipes as written: every phase leaves >= 8 GiB, vLLM has >= 0.6 of the GPU, and
    the planner reads their recompute and offload (not planning-only options)."""
    tool = _plan_tool()
    args = ["--recipe", str(REPO / "recipes" / recipe), "--model", model, "--nodes", str(nodes)]
    assert tool.main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["recipe_fits"] and out["headroom_gib"] >= 8, out
    assert out["layout"]["gpu_memory_utilization"] >= 0.6 and out["layout"]["offload"] == "rollout"
    assert out["kv_sequences_per_replica"] >= 20
    assert tool.main([*args, "--set", "rollout.offload_training_state=false"]) == 0
    resident = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not resident["recipe_fits"] and resident["layout"]["offload"] == "none"
    # The recipe's sleep level and checkpoint mode reach the pinned host memory.
    pinned = out["pinned_gib_per_gpu"]
    assert "vllm_weights" not in pinned and out["host_gib_per_node"] > 8 * 20
    more = ["--set", "rollout.sleep_level=1", "--set", "trainer.checkpoint_async=true"]
    assert tool.main([*args, *more]) == 0
    level1 = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["pinned_gib_per_gpu"]
    assert level1["vllm_weights"]["label"] == "estimated"
    assert level1["checkpoint_staging"]["gib"] > pinned["checkpoint_staging"]["gib"]


if __name__ == "__main__":
    worker(sys.argv[1])


@pytest.mark.unit
def test_checkpoint_bytes_per_rank_and_the_critics_own_optimizer() -> None:
    """The per-rank checkpoint figure the dry run (planning/dry_run.py) checks against megatron's
    save plan: weights + fp32 main copy + two moments, split over DP x CP; norms replicated over
    TP only from TP rank 0 (with the distributed optimizer, only their weights); fp32 with the
    distributed optimizer saves its main copy too; the critic's optimizer setting is its own."""
    model = hf("qwen2.5-32b")
    work = paper_workload()
    params = shard_param_count(model, PAPER, head="lm", pp_rank=0)
    norms = host.tp_replicated_param_count(model, PAPER, head="lm", pp_rank=0)
    assert norms == (2 * 64 + 1) * 5120
    first = host.checkpoint_bytes(model, PAPER, work, head="lm", pp_rank=0, tp_rank=0)
    assert first == math.ceil(params * 14 / 16)
    other = host.checkpoint_bytes(model, PAPER, work, head="lm", pp_rank=0, tp_rank=1)
    assert other == math.ceil((params * 14 - norms * 2) / 16)
    fp32 = replace(work, bf16=False)
    assert host.checkpoint_bytes(model, PAPER, fp32, head="lm", pp_rank=0) == math.ceil(
        params * 16 / 16
    )
    plain = replace(fp32, distributed_optimizer=False)
    assert host.checkpoint_bytes(model, PAPER, plain, head="lm", pp_rank=0) == math.ceil(
        params * 12 / 16
    )
    critic_plain = replace(work, critic_distributed_optimizer=False)
    critic = mp.stage_state(model, PAPER, critic_plain, head="value", pp_rank=0)
    policy = mp.stage_state(model, PAPER, critic_plain, head="lm", pp_rank=0)
    assert critic.optimizer == 12 * shard_param_count(model, PAPER, head="value", pp_rank=0)
    assert policy.optimizer == math.ceil(12 * params / 16)
