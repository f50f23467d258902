"""The weight sync (step 2 of a step, and before an evaluation): the policy's Megatron shards
streamed as full HF-named tensors, in buckets, into the rollout engine replicas."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vapo_megatron.weights.stream import stream_plan, stream_policy_weights

if TYPE_CHECKING:
    from vapo_megatron.rollout.engine import RolloutEngine, WeightUpdateStats
    from vapo_megatron.trainer.model_engine import ModelEngine
    from vapo_megatron.trainer.session import Session
    from vapo_megatron.weights.gather import GatherBuffers


def sync_weights(session: Session) -> dict[str, float]:
    """Stream the policy's weights into the rollout engine replicas (``push_policy_weights``).

    The engine's weights are woken first and its KV cache after, so the buckets in flight never
    share the device with the KV cache (the engine raises on any other order). On CPU vLLM has
    no sleep mode: only the order is checked."""
    session.rollout.wake_up(["weights"])
    stats = push_policy_weights(
        session.policy, session.rollout, bucket_bytes=session.config.rollout.weight_bucket_bytes
    )
    session.rollout.wake_up(["kv_cache"])
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
    engine replica keeps its vLLM TP slice; ``bucket_bytes`` bounds the stream's PP messages
    and the engine's messages. The stream's plan lets each message go before the next tensor
    is gathered (one message in flight per rank). ``buffers``: a ``GatherBuffers`` pool to keep
    across calls (warm memory at the start of each sync, 3-7% faster on CPU, at the cost of
    holding it in between; the trainer keeps none, docs/rollout.md); None gives each sync its
    own.
    ``prefetch``: see ``RolloutEngine.update_weights``. Collective over the policy's TP and PP
    groups."""
    policy.gather_params()  # the last update's shards, with overlap_param_gather
    buckets = stream_policy_weights(
        policy.chunks, policy.record, policy.config,
        tp_group=policy.groups.parallel.tp, pp_group=policy.groups.parallel.pp,
        ep_group=policy.groups.pg_collection.ep, expt_tp_group=policy.groups.pg_collection.expt_tp,
        bucket_bytes=bucket_bytes, buffers=buffers,
    )  # fmt: skip
    return rollout.update_weights(
        (named for bucket in buckets for named in bucket),
        bucket_bytes=bucket_bytes,
        prefetch=prefetch,
        plan=stream_plan(policy.record, policy.config, pp_size=policy.layout.pp),
    )
