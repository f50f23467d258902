"""Fixes for megatron-core 0.16.1 call sites that ignore a model's own process groups.

``SelfAttention.get_query_key_value_tensors``, when a model has fewer KV heads than TP ranks
(Qwen2-0.5B/1.5B at TP 4, a 1-KV-head model at TP 2), gathers the fused QKV activations with
``all_gather_last_dim_from_tensor_parallel_region(x)`` and reads
``get_tensor_model_parallel_rank()``: both from ``parallel_state``, not from the layer's
``pg_collection``. With per-model groups (policy and critic at different layouts) that is
the wrong group, or None. The patch runs that method with the layer's TP group in a
thread-local, which the two module-level names of ``megatron.core.transformer.attention``
then use. With no group set (``parallel_state`` callers) they behave as before.
"""

from __future__ import annotations

import functools
import threading

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

    @functools.wraps(original)
    def get_qkv(self, *args, **kwargs):
        previous = getattr(_state, "tp_group", None)
        _state.tp_group = self.pg_collection.tp
        try:
            return original(self, *args, **kwargs)
        finally:
            _state.tp_group = previous

    attention.all_gather_last_dim_from_tensor_parallel_region = gather_with_layer_group
    attention.get_tensor_model_parallel_rank = rank_in_layer_group
    attention.SelfAttention.get_query_key_value_tensors = get_qkv
    _applied = True
