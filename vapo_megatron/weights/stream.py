"""The policy's weights, from Megatron shards to full HF-named tensors on every rollout rank.

Each pipeline stage gathers its own layers over tensor parallelism (``gather.py``,
through the model record: fused QKV and gate/up split back, vocabulary padding trimmed). With
pipeline parallelism the stages then take turns broadcasting their tensors, one bucket at a
time, over the pipeline group, so every rank ends up with every tensor, in one fixed order
(stage 0's tensors, then stage 1's, ...; within a stage, the record's order), while holding at
most one bucket beyond its own shards. Receivers know every name, shape and dtype in advance
from the record, so a bucket travels as one flat buffer.

These buckets are the only ones between the Megatron gather and the rollout engine: the engine
loads each as one message (``RolloutEngine.update_weights``), the HF export writes them as they
come (``weights/export.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core.transformer import TransformerConfig

from vapo_megatron.parallel import collectives
from vapo_megatron.weights.buckets import NamedTensor, iter_buckets
from vapo_megatron.weights.gather import (
    GatherBuffers,
    ep_hf_names,
    gather_hf_weights,
    model_chunks_of_rank,
)
from vapo_megatron.weights.record import ModelRecord


def _stage_plan(record: ModelRecord, config: TransformerConfig, stage: int, dtype: torch.dtype):
    """(name, meta tensor) of every HF tensor pipeline stage ``stage`` exports, in order
    (its routed experts gathered over expert parallelism: ``gather.ep_hf_names``)."""
    for chunk in model_chunks_of_rank(config, stage):
        for m in record.tensor_maps(chunk).values():
            if not record.exports(m):
                continue
            for name in ep_hf_names(record, m, chunk):
                yield name, torch.empty(record.hf_shape(name), dtype=dtype, device="meta")


def stream_plan(
    record: ModelRecord, config: TransformerConfig, *, pp_size: int
) -> list[NamedTensor]:
    """(HF name, meta tensor) of every tensor ``stream_policy_weights`` yields, in its order,
    with ``pp_size`` pipeline stages (the same on every receiving rank). Passed to the engine's
    ``update_weights(plan=)``, it lets a bucket close before the tensor that does not fit is
    gathered."""
    dtype = config.params_dtype
    return [
        named for stage in range(pp_size) for named in _stage_plan(record, config, stage, dtype)
    ]


def stream_policy_weights(
    models: list[torch.nn.Module],
    record: ModelRecord,
    config: TransformerConfig,
    *,
    tp_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None,
    bucket_bytes: int,
    buffers: GatherBuffers | None = None,
    ep_group: dist.ProcessGroup | None = None,
    expt_tp_group: dist.ProcessGroup | None = None,
) -> Iterator[list[NamedTensor]]:
    """Buckets of the whole model's full HF-named tensors, on every rank of the replica, each
    at most ``bucket_bytes`` (a tensor larger than that alone), in ``stream_plan``'s order.

    MoE models: each stage's routed experts are gathered over ``expt_tp_group`` (None: TP)
    and ``ep_group`` (None: EP = 1) one local expert slot and one HF tensor at a time
    (``gather.gather_hf_weights``), so every rank gets every expert. The bound for 128-expert
    layers: a bucket holds whole HF tensors (one expert's gate, up or down projection at
    most), never a layer's experts at once, and besides the bucket a rank holds one EP gather:
    EP x one expert projection (Qwen3-235B-A22B in bf16 at EP 8: 8 x 12.6 MB = 101 MB), and
    its expert-TP gather, whatever the number of experts (vLLM holds a whole layer's: the
    planner's ``sync_hold_bytes``).

    With PP = 1 nothing crosses ranks after the TP gathers: the tensors are bucketed along the
    stage's plan, so a bucket is yielded before the tensor that would overflow it is gathered
    (one bucket held, not one bucket and the next tensor). With PP > 1 a bucket is one
    broadcast message of the stage whose turn it is.

    Collective over the TP and PP groups: every rank of the model replica must consume the
    iterator to the end. Tensors come in the parameters' dtype (``config.params_dtype``).

    Gathers, conversions and PP bucket buffers come from ``buffers`` (if None, a pool of this
    call's own that keeps at most ``bucket_bytes``), recycled as soon as the consumer and the
    engine drop what they were handed: a consumer that lets go of each bucket once loaded
    keeps the stream's memory to what is in flight. Pass one pool to successive syncs to
    start each with warm memory (held in between). Yielded tensors may be views of pooled
    buffers (never overwritten while referenced): clone one to keep it apart.
    """
    if buffers is None:
        buffers = GatherBuffers(limit_bytes=bucket_bytes)
    # PP messages live where the parameters do: the pipeline group's backend is the model's.
    device = next(models[0].parameters()).device
    pp_size = 1 if pp_group is None else dist.get_world_size(pp_group)
    pp_rank = 0 if pp_group is None else dist.get_rank(pp_group)
    for stage in range(pp_size):
        own = stage == pp_rank
        gathered = (
            gather_hf_weights(
                models,
                record,
                config,
                tp_group=tp_group,
                pp_rank=pp_rank,
                buffers=buffers,
                ep_group=ep_group,
                expt_tp_group=expt_tp_group,
            )
            if own
            else None
        )
        if pp_size == 1:  # nothing crosses ranks any more: bucket along the stage's plan
            plan = _stage_plan(record, config, stage, config.params_dtype)
            yield from iter_buckets(gathered, bucket_bytes, plan=plan)
            continue
        source = dist.get_global_rank(pp_group, stage)
        for views, flat in _bucket_buffers(
            record, config, stage, bucket_bytes, gathered if own else None, device, buffers
        ):
            collectives.broadcast(flat, src=source, group=pp_group)
            yield views
            del views, flat  # the consumer's hold alone decides when the buffer is reused
        if own:
            assert next(gathered, None) is None, "the record's plan missed a tensor"


def _bucket_buffers(record, config, stage, bucket_bytes, source, device, buffers=None):
    """(views, flat buffer) per bucket of ``stage``'s plan, on ``device``; filled from
    ``source`` if given. The flat buffer comes from ``buffers`` when given (the broadcast
    path), else it is new."""
    dtype = config.params_dtype
    for plan in iter_buckets(_stage_plan(record, config, stage, dtype), bucket_bytes):
        numel = sum(meta.numel() for _, meta in plan)
        flat = (
            torch.empty(numel, dtype=dtype, device=device)
            if buffers is None
            else buffers.take((numel,), dtype, device)
        )
        views, offset = [], 0
        for name, meta in plan:
            view = flat[offset : offset + meta.numel()].view(meta.shape)
            offset += meta.numel()
            if source is not None:
                got_name, tensor = next(source)
                assert got_name == name, (got_name, name)  # record order on both sides
                view.copy_(tensor)
                del tensor  # its gather buffer goes back to the pool
            views.append((name, view))
        yield views, flat
        del views, flat
