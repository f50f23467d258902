"""GPU performance settings: kernel fusions and DDP communication overlap, resolved once.

Each switch is ``auto``, ``true`` or ``false``. ``auto`` means on when training on CUDA and the
kernel it needs is installed, off otherwise; on CPU every ``auto`` resolves to megatron-core's
default (off), so the CPU path is what it was before these switches. An explicit ``true`` whose
kernel is missing is a ValueError naming the package. :func:`resolve` logs what it chose.

What megatron-core 0.16.1 needs for each (paths under ``megatron/core/``):

- ``bias_activation_fusion``: ``transformer/mlp.py:171-211`` calls ``bias_swiglu_impl``
  (``fusions/fused_bias_swiglu.py:209``; bias-free SwiGLU when ``add_bias_linear=False``, our
  Qwen2 case), whose kernels are ``@jit_fuser`` = ``torch.compile`` (``jit.py:21``): Inductor,
  i.e. triton on CUDA. ``TransformerConfig.__post_init__`` (``transformer_config.py:1485-1516``)
  accepts SiLU with ``gated_linear_unit=True`` without a bias; it refuses it together with
  ``use_te_activation_func``, which we leave off. Used by both the local and the TE spec (the
  activation is megatron's MLP code in both).
- ``apply_rope_fusion``: ``models/common/embeddings/rope_utils.py:268-291`` calls Transformer
  Engine's fused RoPE (``extensions/transformer_engine.py:2335-2385``; packed THD with CP needs
  TE >= 1.12). ``__post_init__`` raises "apply_rope_fusion is not available. Please install
  TE >= 1.4" when TE is absent (``transformer_config.py:1530-1552``). Unfused, packed
  sequences take ``_apply_rotary_pos_emb_thd`` (``rope_utils.py:204``): a ``.tolist()`` device
  sync and a Python loop over the sequences in every layer.
- ``masked_softmax_fusion``: read only by megatron's local ``DotProductAttention``
  (``transformer/dot_product_attention.py:104`` -> ``fusions/fused_softmax.py:254``, kernels
  ``scaled_*masked_softmax_cuda`` from apex, imported at first use). Neither attention we
  build reads it: TE's ``TEDotProductAttention`` has its own softmax and the local spec uses
  ``models/attention.py``. It matters only to a caller that passes megatron's local spec.
- ``gradient_accumulation_fusion``: the wgrad GEMM accumulates into ``param.main_grad`` (DDP's
  fp32 buffer) with apex's ``fused_weight_gradient_mlp_cuda`` (``tensor_parallel/layers.py:44-48,
  561-577``). TE's linears fuse it themselves (``fuse_wgrad_accumulation``,
  ``extensions/transformer_engine.py:626,828``), but GPTModel's output layer is megatron's own
  ``ColumnParallelLinear`` (``models/gpt/gpt_model.py:241``), whose constructor raises a
  RuntimeError without the apex module (``tensor_parallel/layers.py:924``): apex is needed even
  with TE.
- ``moe_grouped_gemm`` (MoE models): TE's spec then builds a rank's experts as one
  ``TEGroupedMLP`` (``models/gpt/moe_module_specs.py``, ``TESpecProvider.grouped_mlp_modules``):
  one grouped GEMM for all local experts, weights ``linear_fc1.weight{j}`` instead of
  SequentialMLP's ``local_experts.{j}.linear_fc1.weight`` (``provider.default_layer_spec``
  takes the resolved switch; the record reads ``provider.uses_grouped_experts``).
- ``moe_permute_fusion`` (MoE models): the all-to-all dispatcher's token permutation with TE's
  fused kernels; ``TransformerConfig.__post_init__`` (``transformer_config.py``) raises when TE
  lacks ``fused_permute`` and friends. Dense models drop both switches
  (``provider.transformer_config``).
- ``overlap_grad_reduce``: DDP buckets reduce asynchronously from backward hooks
  (``distributed/distributed_data_parallel.py:425-448``) once a bucket's parameters have
  reported as often as in the first batch (``param_and_grad_buffer.py:539-562``). That count
  is right only when the schedule enters ``model.no_sync()`` for all but the last micro-batch,
  which it does only through ``TransformerConfig.no_sync_func`` (``schedules.py:588-590,
  935-946``; Megatron-LM's ``training.py`` sets it). Without it, a step with more
  micro-batches than the first dispatches the reduction early (silently wrong gradients), one
  with fewer never dispatches it (``param_and_grad_buffer.py:531`` assertion). Our micro-batch
  count varies per step (token-budget packing).
- ``overlap_param_gather``: needs the distributed optimizer (forward pre-hooks only then,
  ``distributed_data_parallel.py:347-352``) and, in Megatron-LM, ``overlap_grad_reduce``
  (``megatron/training/arguments.py``: "Must use --overlap-param-gather with
  --overlap-grad-reduce"). The optimizer step then leaves other ranks' shards stale
  (``optimizer/distrib_optimizer.py:2617``) until the next forward's pre-hook gathers them, so
  whoever reads weights outside a forward (weight sync to vLLM, checkpoint save, the reload
  after loading weights) must first force the gather (``start_param_sync(force_sync=True)``
  or ``disable_forward_pre_hook()``, ``distributed_data_parallel.py:367-382``).
- ``grad_reduce_in_fp32``: fp32 gradient buffers for bf16 parameters
  (``distributed_data_parallel.py:147``); no kernel. ``auto`` keeps the trainer's existing
  choice (on exactly when parameters are bf16; ``planning/memory.py`` counts 4-byte grads).

``ModelEngine`` sets ``no_sync_func`` when ``overlap_grad_reduce`` is on and forces the
parameter gather (``ModelEngine.gather_params``) before every read outside a forward: the weight
sync, the HF export, checkpoint saves and ``hf_weights``. It resolves with
``overlap_hooks=True``; ``tests/distributed/engine/test_overlap.py`` holds overlapped updates
equal to plain ones with a micro-batch count that changes every step (gloo, asynchronous handles).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from dataclasses import dataclass
from typing import Literal

import torch

logger = logging.getLogger("vapo_megatron")

Switch = Literal["auto"] | bool
"""auto: on when the run is on CUDA and the kernel is installed; true: on (error when it cannot
be); false: off."""

FUSION_KERNELS: dict[str, tuple[str, str]] = {
    "bias_activation_fusion": ("triton", "triton (torch.compile's CUDA backend)"),
    "apply_rope_fusion": ("transformer_engine", "transformer-engine"),
    "masked_softmax_fusion": (
        "scaled_upper_triang_masked_softmax_cuda",
        "apex built with --cuda_ext (scaled_upper_triang_masked_softmax_cuda)",
    ),
    "gradient_accumulation_fusion": (
        "fused_weight_gradient_mlp_cuda",
        "apex built with --cpp_ext --cuda_ext (fused_weight_gradient_mlp_cuda)",
    ),
    "moe_grouped_gemm": ("transformer_engine", "transformer-engine"),
    "moe_permute_fusion": ("transformer_engine", "transformer-engine"),
}
"""Fusion -> (module that must be importable, what to install when it is not)."""


@dataclass(frozen=True, kw_only=True)
class GpuSettings:
    """Kernel fusions and communication overlap of training (megatron-core leaves each off)."""

    bias_activation_fusion: Switch = "auto"
    """Fused SwiGLU in the MLP (torch.compile; needs triton on CUDA)."""
    apply_rope_fusion: Switch = "auto"
    """Transformer Engine's fused RoPE (the unfused packed path syncs and loops per layer)."""
    masked_softmax_fusion: Switch = "auto"
    """apex's fused softmax in megatron's local DotProductAttention (our attentions ignore it)."""
    gradient_accumulation_fusion: Switch = "auto"
    """Accumulate weight grads into the fp32 main_grad inside the GEMM (needs apex's fused_weight_gradient_mlp_cuda, even with TE)."""
    moe_grouped_gemm: Switch = "auto"
    """MoE models: the experts of a rank as one grouped GEMM (TE's TEGroupedMLP, names linear_fc1.weight{j}) instead of one MLP each; needs Transformer Engine."""
    moe_permute_fusion: Switch = "auto"
    """MoE models: TE's fused token permute/unpermute around the all-to-all dispatch."""
    overlap_grad_reduce: Switch = "auto"
    """Reduce gradient buckets during backward (the engine sets megatron's no_sync_func)."""
    overlap_param_gather: Switch = "auto"
    """Gather updated parameter shards during the next forward (distributed optimizer and overlap_grad_reduce)."""
    grad_reduce_in_fp32: Switch = "auto"
    """Keep and reduce gradients in fp32 (auto: when parameters are bf16)."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value != "auto" and not isinstance(value, bool):
                raise ValueError(f"gpu.{field.name}={value!r} must be auto, true or false")


@dataclass(frozen=True, kw_only=True)
class ResolvedGpuSettings:
    """What :func:`resolve` chose: plain booleans for TransformerConfig and the DDP config."""

    bias_activation_fusion: bool = False
    """Fused SwiGLU."""
    apply_rope_fusion: bool = False
    """TE's fused RoPE."""
    masked_softmax_fusion: bool = False
    """apex's fused softmax (local DotProductAttention only)."""
    gradient_accumulation_fusion: bool = False
    """Weight-gradient GEMM accumulates into main_grad."""
    moe_grouped_gemm: bool = False
    """TE's grouped-GEMM experts (MoE models; dense models ignore it)."""
    moe_permute_fusion: bool = False
    """TE's fused token permutation (MoE models; dense models ignore it)."""
    overlap_grad_reduce: bool = False
    """Asynchronous gradient reduction during backward."""
    overlap_param_gather: bool = False
    """Asynchronous parameter gather during forward."""
    grad_reduce_in_fp32: bool = False
    """fp32 gradient buffers."""

    def transformer_config_kwargs(self) -> dict[str, bool]:
        """The TransformerConfig fields among these."""
        return {name: getattr(self, name) for name in FUSION_KERNELS}

    def ddp_config_kwargs(self) -> dict[str, bool]:
        """The DistributedDataParallelConfig fields among these."""
        names = ("overlap_grad_reduce", "overlap_param_gather", "grad_reduce_in_fp32")
        return {name: getattr(self, name) for name in names}


def kernel_available(module: str) -> bool:
    """Whether ``module`` can be imported (found on the path; not imported here)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def resolve(
    settings: GpuSettings,
    *,
    bf16: bool,
    distributed_optimizer: bool,
    overlap_hooks: bool = False,
    cuda: bool | None = None,
    name: str = "model",
) -> ResolvedGpuSettings:
    """Turn ``auto``/``true``/``false`` into what this run uses; ValueError for an impossible
    ``true``.

    ``overlap_hooks``: the caller sets ``TransformerConfig.no_sync_func`` (and gathers
    parameters before reading them outside a forward) as the overlaps need; see the module doc.
    ``cuda``: None reads ``torch.cuda.is_available()``. ``name`` labels the log line.
    """
    if cuda is None:
        cuda = torch.cuda.is_available()
    chosen: dict[str, bool] = {}
    why: dict[str, str] = {}
    for field, (module, package) in FUSION_KERNELS.items():
        value = getattr(settings, field)
        if value is False:
            chosen[field], why[field] = False, "set"
            continue
        have = cuda and kernel_available(module)
        if value is True and not have:
            missing = "no CUDA device" if not cuda else f"{module} is not installed"
            raise ValueError(
                f"gpu.{field}=true needs {package} on CUDA ({missing}); install it or set "
                f"gpu.{field}=auto (on only where it can be) or false"
            )
        chosen[field] = have
        why[field] = "set" if value is True else ("auto: found" if have else "auto: unavailable")

    grad_fp32 = settings.grad_reduce_in_fp32
    chosen["grad_reduce_in_fp32"] = bf16 if grad_fp32 == "auto" else grad_fp32
    why["grad_reduce_in_fp32"] = "auto: bf16 params" if grad_fp32 == "auto" else "set"

    overlaps = (
        ("overlap_grad_reduce", settings.overlap_grad_reduce, True),
        ("overlap_param_gather", settings.overlap_param_gather, distributed_optimizer),
    )
    for field, value, possible in overlaps:
        if field == "overlap_param_gather":
            possible = possible and chosen["overlap_grad_reduce"]
        if value is True:
            if not overlap_hooks:
                raise ValueError(
                    f"gpu.{field}=true: the trainer does not yet set megatron's no_sync_func and "
                    f"parameter-gather hooks, without which overlapped reductions are wrong "
                    f"when the number of micro-batches changes; set gpu.{field}=false or auto"
                )
            if not possible:
                raise ValueError(
                    f"gpu.overlap_param_gather=true needs the distributed optimizer and "
                    f"overlap_grad_reduce (got distributed_optimizer={distributed_optimizer}, "
                    f"overlap_grad_reduce={chosen['overlap_grad_reduce']}); set "
                    f"{name}.optim.distributed_optimizer=true and gpu.overlap_grad_reduce=true, "
                    f"or gpu.overlap_param_gather=false"
                )
        chosen[field] = value is True or (value == "auto" and cuda and overlap_hooks and possible)
        why[field] = "set" if value != "auto" else ("auto" if overlap_hooks else "auto: no hooks")

    resolved = ResolvedGpuSettings(**chosen)
    logger.info(
        "%s gpu settings (%s): %s",
        name,
        "cuda" if cuda else "cpu",
        ", ".join(f"{k}={'on' if v else 'off'} ({why[k]})" for k, v in chosen.items()),
    )
    return resolved
