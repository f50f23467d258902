"""The weight sync (step 2 of a step, and before an evaluation): the policy's Megatron shards
streamed as full HF-named tensors, in buckets, into the rollout engine replicas.

The buckets are made once, by the stream (``ModelEngine.hf_buckets``, ``weights/stream.py``),
at the size of one engine message (``RolloutEngine.message_bytes``), and loaded as they come.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vapo_megatron.engine.model_engine import ModelEngine
    from vapo_megatron.rollout.engine import RolloutEngine, WeightUpdateStats
    from vapo_megatron.step.context import StepContext
    from vapo_megatron.weights.gather import GatherBuffers


def sync_weights(ctx: StepContext) -> dict[str, float]:
    """Stream the policy's weights into the rollout engine replicas (``push_policy_weights``).

    The engine's weights are woken first and its KV cache after, so the buckets in flight never
    share the device with the KV cache (the engine raises on any other order). On CPU vLLM has
    no sleep mode: only the order is checked."""
    ctx.rollout.wake_up(["weights"])
    stats = push_policy_weights(
        ctx.policy, ctx.rollout, bucket_bytes=ctx.config.rollout.weight_bucket_bytes
    )
    ctx.rollout.wake_up(["kv_cache"])
    return {"sync/gb": stats.num_bytes / 1e9, "sync/buckets": stats.num_buckets}


def push_policy_weights(
    policy: ModelEngine,
    rollout: RolloutEngine,
    *,
    bucket_bytes: int,
    buffers: GatherBuffers | None = None,
    prefetch: bool | None = None,
) -> WeightUpdateStats:
    """Every rank receives every full HF tensor of the policy, in process, and its part of its
    engine replica keeps its vLLM TP slice. ``bucket_bytes`` bounds the sync's weight bytes in
    flight: the stream's buckets (its PP messages) are the engine's messages, a whole
    ``bucket_bytes`` each, or half with ``prefetch`` (``RolloutEngine.update_weights``; the
    next message is produced while one loads). A bucket is yielded before the tensor that does
    not fit is gathered (one message in flight per rank). ``buffers``: a ``GatherBuffers``
    pool to keep across calls (warm memory at the start of each sync, 3-7% faster on CPU, at
    the cost of holding it in between; the trainer keeps none, docs/rollout.md); None gives
    each sync its own. Collective over the policy's TP, PP and expert groups."""
    message_bytes = rollout.message_bytes(bucket_bytes, prefetch)
    messages = policy.hf_buckets(message_bytes, buffers=buffers)
    return rollout.update_weights(messages, prefetch=prefetch)
