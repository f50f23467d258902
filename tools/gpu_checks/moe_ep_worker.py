"""Worker of part ``moe_ep`` (one of 2 ranks): the tiny Qwen3-MoE at EP 2 with the alltoall
dispatcher against the same model at EP 1, on the same weights, data and routes.

Usage: ``python -m gpu_checks.moe_ep_worker WORKDIR DTYPE`` as 2 ranks (``spawn.run_ranks``).

Both layouts are built as the trainer builds them (``ModelEngine`` with ``layer_spec=None`` and
``GpuSettings()``: on a GPU with Transformer Engine its spec with grouped GEMM and permute
fusion, else the local spec's SequentialMLP; ``MoESettings(token_dispatcher="alltoall")``):

- EP 1: DP 2, every expert on both ranks, expert gradients reduced over DP;
- EP 2: DP 2 and expert DP 1, 4 experts per rank (``num_local_experts = 8 / 2``, megatron's
  ``local_expert_indices_offset = ep_rank * 4``); each MoE layer's
  ``MoEAlltoAllTokenDispatcher`` exchanges the routed tokens with ``all_to_all_single`` over the
  EP group (``transformer/moe/token_dispatcher.py``: ``tokens_per_expert`` first, then the
  permuted hidden states, and back after the experts). That is a collective per MoE layer and
  micro-batch, so both ranks run the same number of micro-batches (padded with an empty one,
  as ``step/scoring_pass.py`` gives a rank without samples).

Each rank packs its own half of the check's step. EP 1 records its routes, EP 2 replays them
(``moe_compare``); then the logits, every HF tensor's gradient this rank holds at EP 2 (dense
ones and its 4 experts' under their global names) against EP 1's, and both grad norms (expert
grads reduced over expert DP, the norm over ``tp_ep_pp``) must agree.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from gpu_checks.frame import check
from gpu_checks.moe_compare import (
    GRAD_TOLERANCE,
    agreement,
    grad_diff,
    hf_grads,
    keep_logits,
    logit_diff,
    logsumexp_loss,
    moe_modules,
    record_routes,
)
from gpu_checks.moe_part import MOE_CONFIG, moe_hf_tensors
from gpu_checks.spawn import write_result
from gpu_checks.tiny import LOGIT_TOLERANCE, OPTIM, random_step
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.moe import MoESettings
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.parallel.model_groups import build_model_groups, ensure_global_memory_buffer
from vapo_megatron.step.batching import build_samples, empty_micro_batch, micro_batches
from vapo_megatron.trainer.session import init_distributed

WORLD = 2


def engine_at(ep: int, hf: HFModelConfig, dtype: torch.dtype, host) -> ModelEngine:
    groups = build_model_groups(tp=1, pp=1, cp=1, ep=ep, host=host)
    ensure_global_memory_buffer()
    engine = ModelEngine(
        hf, ModelLayout(ep=ep), head="lm", groups=groups, params_dtype=dtype, optim=OPTIM,
        moe=MoESettings(token_dispatcher="alltoall"),
    )  # fmt: skip
    engine.load_hf(moe_hf_tensors(hf, dtype))
    engine.track_routes(replay=True)
    return engine


def my_micro_batches(engine: ModelEngine, vocab: int, host) -> list:
    """This rank's half of the step, packed; as many micro-batches on every rank."""
    step = random_step(vocab)
    mine = range(dist.get_rank(), len(step.prompts), WORLD)
    samples = build_samples(step.prompts, step.responses, mine, step.offsets)
    mbs = micro_batches(samples, engine.layout, cp_rank=0, token_budget=48, field_names=[])
    count = torch.tensor([len(mbs)], dtype=torch.long, device=HOST)
    collectives.all_reduce(count, host, dist.ReduceOp.MAX)
    pad = [empty_micro_batch(engine.layout, cp_rank=0, field_names=[])]
    return mbs + pad * (int(count) - len(mbs))


def compare(ep1: ModelEngine, ep2: ModelEngine, mbs: list, vocab: int) -> dict:
    """Logits, gradients and grad norms of EP 2 against EP 1 (collective: both ranks)."""
    reference, routed = record_routes(ep1, mbs, vocab)
    outputs = ep2.run(routed, keep_logits(vocab), forward_only=True)
    worst, scale = logit_diff(outputs, reference)
    numbers = {"micro_batches": len(mbs), "route_agreement": agreement(ep2),
               "max_abs_logit_diff": worst, "logit_scale": scale}  # fmt: skip
    grads = {}
    for name, engine in (("ep1", ep1), ("ep2", ep2)):
        engine.run(routed, logsumexp_loss(vocab))
        grads[name] = hf_grads(engine)
    rel, where, count = grad_diff(grads["ep2"], grads["ep1"])
    experts = sorted({n.split(".mlp.experts.")[1].split(".")[0]
                      for n in grads["ep2"] if ".mlp.experts." in n})  # fmt: skip
    numbers.update(max_grad_rel_diff=rel, worst_grad=where, grad_tensors=count,
                   experts_here=experts)  # fmt: skip
    numbers["grad_norms"] = [ep1.step()["grad_norm"], ep2.step()["grad_norm"]]
    return numbers


def main(workdir: str, dtype_name: str) -> None:
    init_distributed()  # NCCL on GPU LOCAL_RANK; gloo and the CPU shim on CPU
    dtype = getattr(torch, dtype_name)
    host = collectives.make_host_group()
    hf = HFModelConfig.from_hf(MOE_CONFIG)
    ep1, ep2 = (engine_at(ep, hf, dtype, host) for ep in (1, 2))
    numbers = compare(ep1, ep2, my_micro_batches(ep2, hf.vocab_size, host), hf.vocab_size)
    numbers.update(
        rank=dist.get_rank(), backend=dist.get_backend(), device=str(ep2.device),
        spec=layer_spec_kind_of(ep2), modules=sorted(moe_modules(ep2)),
        ep_sizes=[ep1.groups.ep_size, ep2.groups.ep_size],
    )  # fmt: skip
    dist.barrier(group=host)
    write_result(workdir, dist.get_rank(), numbers)
    check_numbers(numbers, dtype)
    dist.destroy_process_group()


def layer_spec_kind_of(engine: ModelEngine) -> str:
    return engine.record.layer_spec + (" grouped" if engine.record.grouped_experts else "")


def check_numbers(numbers: dict, dtype: torch.dtype) -> None:
    """This rank's verdicts (after every collective, so a failure does not strand the other)."""
    tolerance = LOGIT_TOLERANCE[dtype] * numbers["logit_scale"]
    check(numbers["ep_sizes"] == [1, 2], f"EP sizes {numbers['ep_sizes']}")
    check("MoEAlltoAllTokenDispatcher" in numbers["modules"], f"built {numbers['modules']}")
    check(len(numbers["experts_here"]) == 4, f"EP 2 rank holds experts {numbers['experts_here']}")
    worst = numbers["max_abs_logit_diff"]
    check(worst <= tolerance, f"EP 2 vs EP 1 logits differ by {worst:.3g} > {tolerance:.3g}")
    rel = numbers["max_grad_rel_diff"]
    check(
        rel <= GRAD_TOLERANCE[dtype],
        f"EP 2 vs EP 1 gradient of {numbers['worst_grad']}: relative {rel:.3g}",
    )
    a, b = numbers["grad_norms"]
    check(math.isfinite(a) and a > 0, f"EP 1 grad norm {a}")
    check(abs(a - b) <= GRAD_TOLERANCE[dtype] * a, f"grad norms EP 1 {a:.6g} vs EP 2 {b:.6g}")


if __name__ == "__main__":
    main(*sys.argv[1:])
