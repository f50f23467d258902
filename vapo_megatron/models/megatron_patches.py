"""Fixes for megatron-core 0.16.1 call sites that ignore a model's own process groups.

``SelfAttention.get_query_key_value_tensors``, when a model has fewer KV heads than TP ranks
(Qwen2-0.5B/1.5B at TP 4, a 1-KV-head model at TP 2), gathers the fused QKV activations with
``all_gather_last_dim_from_tensor_parallel_region(x)`` and reads
``get_tensor_model_parallel_rank()``: both from ``parallel_state``, not from the layer's
``pg_collection``. With per-model groups (policy and critic at different layouts) that is
the wrong group, or None. The patch runs that method with the layer's TP group in a
thread-local, which the two module-level names of ``megatron.core.transformer.attention``
then use. With no group set (``parallel_state`` callers) they behave as before.

DeepSeek-V3's ``MLASelfAttention.get_query_key_value_tensors`` has the same fault: under the
local spec its down projections are column-parallel and their outputs are gathered with
``gather_from_tensor_model_parallel_region(x)`` (and scattered back under sequence
parallelism with ``scatter_to_sequence_parallel_region(x)``), both on ``parallel_state``'s TP
group: the same thread-local gives them the layer's; the KV gather's RoPE-key columns also sum
their gradient over TP (``_gather_summing_rope_key``: megatron leaves each rank only its own
heads' share). And without Transformer Engine,
megatron's ``extensions/transformer_engine.py`` leaves ``te`` a MagicMock, so
``multi_latent_attention``'s TE import succeeds and ``HAVE_TE`` is True; its
``isinstance(self.linear_proj, TELinear)`` then raises ``TypeError`` (TELinear is no type):
``HAVE_TE`` is set False where ``transformer_engine`` is not installed.

A sigmoid router's expert bias (DeepSeek-V3, GLM-4.5) is moved in ``finalize_model_grads`` by
``moe_utils.get_updated_expert_bias``, which all-reduces the token counts over
``parallel_state``'s TP x DP x CP group: absent (AssertionError) or another model's when each
model has its own groups. :func:`finalize_model_grads_on_model_groups` (the engines' finalize
function) runs megatron's with the model's ``pg_collection.tp_dp_cp`` in the thread-local,
which the patched update reduces over; at update rate 0 (the default: the bias frozen) it
returns the bias unchanged with no collective.
"""

from __future__ import annotations

import functools
import importlib.util
import threading

import torch
import torch.distributed as dist

_state = threading.local()
_applied = False


def apply_megatron_patches() -> None:
    """Install the patch once per process (idempotent)."""
    global _applied
    if _applied:
        return
    from megatron.core.transformer import attention

    gather, tp_rank = (
        attention.all_gather_last_dim_from_tensor_parallel_region,
        attention.get_tensor_model_parallel_rank,
    )

    def gather_with_layer_group(x, group=None):
        return gather(x, group if group is not None else getattr(_state, "tp_group", None))

    def rank_in_layer_group(*args, **kwargs):
        group = getattr(_state, "tp_group", None)
        return dist.get_rank(group) if group is not None else tp_rank(*args, **kwargs)

    original = attention.SelfAttention.get_query_key_value_tensors
    get_qkv = _in_layer_group(original)

    attention.all_gather_last_dim_from_tensor_parallel_region = gather_with_layer_group
    attention.get_tensor_model_parallel_rank = rank_in_layer_group
    attention.SelfAttention.get_query_key_value_tensors = get_qkv
    _patch_mla()
    _patch_expert_bias_update()
    _applied = True


def finalize_model_grads_on_model_groups(model, num_tokens=None, pg_collection=None, **kwargs):
    """megatron's ``finalize_model_grads`` with the expert-bias update on the model's own
    TP x DP x CP group (``pg_collection.tp_dp_cp``); a ``config.finalize_model_grads_func``."""
    from megatron.core.distributed import finalize_model_grads

    previous = getattr(_state, "bias_group", None)
    _state.bias_group = None if pg_collection is None else pg_collection.tp_dp_cp
    try:
        return finalize_model_grads(model, num_tokens, pg_collection=pg_collection, **kwargs)
    finally:
        _state.bias_group = previous


def _patch_expert_bias_update() -> None:
    # The module, not the function of the same name that megatron.core.distributed exports.
    module = importlib.import_module("megatron.core.distributed.finalize_model_grads")

    original = module.get_updated_expert_bias

    @functools.wraps(original)
    def updated_expert_bias(tokens_per_expert, expert_bias, update_rate):
        group = getattr(_state, "bias_group", None)
        if update_rate == 0:  # frozen: the counts are reset by megatron after this
            return expert_bias
        if group is None:
            return original(tokens_per_expert, expert_bias, update_rate)
        with torch.no_grad():  # megatron's sign update, reduced over the model's group
            dist.all_reduce(tokens_per_expert, group=group)
            average = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
            return expert_bias + torch.sign(average - tokens_per_expert) * update_rate

    module.get_updated_expert_bias = updated_expert_bias


def _with_layer_group(function):
    """``function(x, group=None)`` that, given no group, takes the thread-local layer group."""

    @functools.wraps(function)
    def wrapped(x, group=None):
        return function(x, group=group if group is not None else getattr(_state, "tp_group", None))

    return wrapped


def _in_layer_group(original):
    """``original`` (an attention's get_query_key_value_tensors) run with its own layer's TP
    group as the one the patched gathers use."""

    @functools.wraps(original)
    def get_qkv(self, *args, **kwargs):
        previous = getattr(_state, "tp_group", None)
        _state.tp_group = self.pg_collection.tp
        try:
            return original(self, *args, **kwargs)
        finally:
            _state.tp_group = previous

    return get_qkv


def _patch_mla() -> None:
    from megatron.core.transformer import multi_latent_attention as mla

    if importlib.util.find_spec("transformer_engine") is None:
        mla.HAVE_TE = False
    mla.scatter_to_sequence_parallel_region = _with_layer_group(
        mla.scatter_to_sequence_parallel_region
    )
    mla.gather_from_tensor_model_parallel_region = _gather_summing_rope_key(
        _with_layer_group(mla.gather_from_tensor_model_parallel_region)
    )
    original = _in_layer_group(mla.MLASelfAttention.get_query_key_value_tensors)

    @functools.wraps(original)
    def get_qkv(self, *args, **kwargs):
        config = self.config
        q_width = getattr(self, "linear_q_down_proj", None)
        q_width = getattr(q_width, "output_size_per_partition", config.q_lora_rank)
        q_gathered = config.q_lora_rank is not None and q_width != config.q_lora_rank
        previous = getattr(_state, "mla_gathers", None)
        _state.mla_gathers = ["q"] * q_gathered + ["kv"]  # the gathers' order in the method
        _state.mla_widths = (config.kv_lora_rank, config.qk_pos_emb_head_dim)
        try:
            return original(self, *args, **kwargs)
        finally:
            _state.mla_gathers = previous

    mla.MLASelfAttention.get_query_key_value_tensors = get_qkv


def _gather_summing_rope_key(gather):
    """megatron's gather of a column-parallel down projection's output, for MLA's
    ``get_query_key_value_tensors``; the KV gather's RoPE-key columns also sum their gradient
    over TP.

    Under the local spec (column-parallel down projections: the CPU path) megatron 0.16.1
    gathers ``[kv_latent | k_rope]`` over TP and uses the shared RoPE key whole on every TP
    rank, each rank for its own heads; the gather's backward keeps each rank's own columns of
    its gradient, so the RoPE key's columns (the last rank's) get only that rank's heads'
    share: its weight rows and the hidden states' gradient miss the other heads' (a TP 2
    step differed from TP 1 by 1.9e-3 at lr 1e-3; forward logits were equal). The latent's
    gradient needs nothing: its up projection already sums it over TP. Transformer Engine's
    spec keeps the down projections whole and sums the key's gradient through its
    sequence-parallel gather. Here the key's columns pass ``_SumGradient`` (identity
    forward, all-reduce backward) after the gather; the q gather (first, when ``q_lora_rank``
    is set) is left as it was."""

    @functools.wraps(gather)
    def gathered(x, group=None):
        out = gather(x, group)
        pending = getattr(_state, "mla_gathers", None)
        if not pending or pending.pop(0) != "kv":
            return out
        latent, rope_key = out.split(list(_state.mla_widths), dim=-1)
        rope_key = _SumGradient.apply(rope_key, group if group is not None else _state.tp_group)
        return torch.cat([latent, rope_key], dim=-1)

    return gathered


class _SumGradient(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over ``group``. (megatron's
    ``copy_to_tensor_model_parallel_region`` would not do here: its ``_reduce`` all-reduces
    ``grad.contiguous()`` and returns ``grad``, so a non-contiguous gradient, as a slice of
    ``torch.cat``'s, comes back unreduced.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
