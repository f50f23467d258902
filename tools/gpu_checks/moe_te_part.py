"""Part ``moe_te``: the tiny Qwen3-MoE under Transformer Engine's spec with grouped GEMM, permute
fusion and the alltoall dispatcher, against the local spec on the same weights.

This is what the MoE recipes build on a GPU: ``ModelEngine`` with ``layer_spec=None`` calls
``provider.default_layer_spec(hf, grouped_gemm=gpu.moe_grouped_gemm)``, and both switches of
``config/gpu.py`` are ``auto`` (on where TE imports on CUDA). What megatron-core 0.16.1 does with
them (read in its sources):

- ``get_gpt_layer_with_transformer_engine_spec(num_experts=8, moe_grouped_gemm=True,
  qk_layernorm=True)`` (``models/gpt/gpt_layer_specs.py``) builds the MoE layer with
  ``get_moe_module_spec_for_backend(TESpecProvider(), ...)`` (``models/gpt/moe_module_specs.py``):
  ``TESpecProvider.grouped_mlp_modules(True, False)`` returns ``TEGroupedMLP`` with
  ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear`` (weights
  ``linear_fc1.weight{j}``, ``linear_fc2.weight{j}``) when TE has grouped linears, else the
  legacy ``GroupedMLP`` with a warning (the record does not map it: this part then fails on
  ``uses_grouped_experts``). The pre-MLP norm stays a module (``fuse_pre_mlp_layernorm: False``).
- ``TransformerConfig(moe_permute_fusion=True)`` imports ``fused_permute``,
  ``fused_permute_with_probs``, ``fused_sort_chunks_by_index(_with_probs)`` and
  ``fused_unpermute`` from ``transformer/moe/moe_utils.py`` in ``__post_init__`` and raises
  "fused permutation is not available. Please install TE >= 2.1.0" when any is None.
- ``moe_token_dispatcher_type='alltoall'`` (``MoESettings``' default; megatron's own default is
  allgather) makes ``MoELayer`` build ``MoEAlltoAllTokenDispatcher``
  (``transformer/moe/moe_layer.py``), whose permutations take ``fused=moe_permute_fusion``
  and keep their index maps on CUDA (``token_dispatcher.py``, ``permute_idx_device``). At EP 1
  the all-to-all is within the rank; the permutation, the grouped GEMM and the unpermutation are
  the kernels under test. EP 2 is part ``moe_ep``.

Checked: the TE build is what the trainer would build (spec kind 'te', grouped experts, both
switches and the dispatcher in its ``TransformerConfig``, ``TEGroupedMLP`` and
``MoEAlltoAllTokenDispatcher`` in the model); with the local build's routes replayed
(``moe_compare``), logits within the logit tolerance of the local spec's and every HF tensor's
gradient within ``GRAD_TOLERANCE``; the routers' agreement is reported. Skipped with ``--cpu``
(TE is CUDA only) and, marked missing, where ``transformer_engine`` does not import.
"""

from __future__ import annotations

import math

from gpu_checks.context import Context
from gpu_checks.frame import Skipped, check
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
from gpu_checks.tiny import LOGIT_TOLERANCE, OPTIM
from vapo_megatron.config.gpu import GpuSettings
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.moe import MoESettings
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.models.provider import (
    default_layer_spec,
    layer_spec_kind,
    local_spec,
    uses_grouped_experts,
)
from vapo_megatron.parallel.model_groups import build_model_groups
from vapo_megatron.step.batching import build_samples, micro_batches

TE_SWITCHES = GpuSettings(moe_grouped_gemm=True, moe_permute_fusion=True)
LOCAL_SWITCHES = GpuSettings(moe_grouped_gemm=False, moe_permute_fusion=False)


def skip_reason(ctx: Context) -> None:
    """Skipped unless this is CUDA with Transformer Engine importable."""
    if ctx.device.type != "cuda":
        raise Skipped("Transformer Engine runs on CUDA only (--cpu)")
    if not ctx.te[0]:
        raise Skipped(
            f"transformer_engine not importable ({ctx.te[1]})", missing="transformer_engine"
        )


def moe_te(ctx: Context, numbers: dict) -> None:
    skip_reason(ctx)
    ctx.results.need("distributed")
    hf = HFModelConfig.from_hf(MOE_CONFIG)
    spec = default_layer_spec(hf, grouped_gemm=True)  # as ModelEngine picks it on a GPU
    numbers.update(spec=layer_spec_kind(spec), grouped_experts=uses_grouped_experts(spec))
    check(numbers["spec"] == "te", "default_layer_spec fell back to the local spec with TE")
    check(numbers["grouped_experts"], "TE's MoE spec without TEGroupedMLP experts")
    local = moe_engine(ctx, hf, local_spec(hf), LOCAL_SWITCHES)
    te = moe_engine(ctx, hf, spec, TE_SWITCHES)
    check_te_build(te, numbers)
    tensors = moe_hf_tensors(hf, ctx.dtype)
    for engine in (local, te):
        engine.load_hf(tensors)
        engine.track_routes(replay=True)
    step = ctx.step
    samples = build_samples(step.prompts, step.responses, range(len(step.prompts)), step.offsets)
    mbs = micro_batches(samples, local.layout, cp_rank=0, token_budget=48, field_names=[])
    reference, routed = record_routes(local, mbs, hf.vocab_size)
    outputs = te.run(routed, keep_logits(hf.vocab_size), forward_only=True)
    worst, scale = logit_diff(outputs, reference)
    tolerance = LOGIT_TOLERANCE[ctx.dtype] * scale
    numbers.update(
        micro_batches=len(mbs), route_agreement=agreement(te), max_abs_logit_diff=worst,
        logit_tolerance=tolerance,
    )  # fmt: skip
    check(worst <= tolerance, f"TE vs local MoE logits differ by {worst:.3g} > {tolerance:.3g}")
    for engine in (local, te):
        engine.run(routed, logsumexp_loss(hf.vocab_size))
    rel, where, count = grad_diff(hf_grads(te), hf_grads(local))
    numbers.update(
        grad_tensors=count, max_grad_rel_diff=rel, grad_tolerance=GRAD_TOLERANCE[ctx.dtype]
    )
    check(rel <= GRAD_TOLERANCE[ctx.dtype], f"TE vs local gradient of {where}: relative {rel:.3g}")
    norms = [engine.step()["grad_norm"] for engine in (local, te)]
    numbers["grad_norms"] = norms
    check(all(math.isfinite(n) and n > 0 for n in norms), f"grad norms {norms}")


def moe_engine(ctx: Context, hf: HFModelConfig, spec, gpu: GpuSettings) -> ModelEngine:
    """A policy of the tiny MoE at world 1 with the alltoall dispatcher."""
    return ModelEngine(
        hf, ModelLayout(), head="lm", groups=build_model_groups(tp=1, pp=1, cp=1, host=ctx.host),
        params_dtype=ctx.dtype, layer_spec=spec, optim=OPTIM, gpu=gpu,
        moe=MoESettings(token_dispatcher="alltoall"),
    )  # fmt: skip


def check_te_build(engine: ModelEngine, numbers: dict) -> None:
    """The engine was built as the MoE recipes build on a GPU (see the module doc)."""
    config = engine.config
    numbers["config"] = {
        "moe_grouped_gemm": config.moe_grouped_gemm,
        "moe_permute_fusion": config.moe_permute_fusion,
        "moe_token_dispatcher_type": config.moe_token_dispatcher_type,
    }
    want = {"moe_grouped_gemm": True, "moe_permute_fusion": True,
            "moe_token_dispatcher_type": "alltoall"}  # fmt: skip
    check(numbers["config"] == want, f"TransformerConfig has {numbers['config']}, want {want}")
    numbers["modules"] = sorted(moe_modules(engine))
    want_modules = ["MoEAlltoAllTokenDispatcher", "TEGroupedMLP"]
    check(numbers["modules"] == want_modules, f"MoE layers built {numbers['modules']}")
