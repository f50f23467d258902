"""Move HF-named weights into this rank's model chunks, and gather them back out.

Both go through the model record (``record.py``), the one HF <-> Megatron map, whose names
must be the model's own parameter names: the record's ``layer_spec`` is the spec the model was
built with (:func:`chunk_parameters` checks it). The way out is what the rollout weight stream
and checkpoint export build on: this rank's pipeline stage, gathered over tensor parallelism, as
full HF-named tensors in a fixed order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import unwrap_model

from vapo_megatron.parallel import collectives
from vapo_megatron.weights.record import ModelChunk, ModelRecord, Split, TensorMap


def model_chunks_of_rank(
    config: TransformerConfig, pp_rank: int, ep_rank: int = 0
) -> list[ModelChunk]:
    """The record's view of each model chunk this pipeline (and expert-parallel) rank builds."""
    vpp = config.virtual_pipeline_model_parallel_size
    if vpp is None:
        return [ModelChunk.for_stage(config, pp_rank, ep_rank=ep_rank)]
    return [
        ModelChunk.for_stage(config, pp_rank, vp_stage, ep_rank=ep_rank) for vp_stage in range(vpp)
    ]


def expert_groups(
    config: TransformerConfig,
    tp_group: dist.ProcessGroup | None,
    ep_group: dist.ProcessGroup | None,
    expt_tp_group: dist.ProcessGroup | None,
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(EP group, expert-TP group) of a model with ``config``, checked against its sizes.

    None for ``expt_tp_group`` means the TP group, which is megatron's expert-TP group when the
    sizes agree (rank order "tp-ep-dp-pp" of the expert groups and "tp-cp-ep-dp-pp" of the
    dense ones both vary TP fastest); None for ``ep_group`` means EP = 1. ValueError when a
    group's size is not the config's (``expert_model_parallel_size``,
    ``expert_tensor_parallel_size``)."""
    ep = 1 if ep_group is None else dist.get_world_size(ep_group)
    if ep != config.expert_model_parallel_size:
        raise ValueError(
            f"the EP group has {ep} ranks but the model was built with "
            f"expert_model_parallel_size={config.expert_model_parallel_size}; pass the "
            "model's own ep group (pg_collection.ep)"
        )
    expt_tp_group = tp_group if expt_tp_group is None else expt_tp_group
    etp = 1 if expt_tp_group is None else dist.get_world_size(expt_tp_group)
    want = config.expert_tensor_parallel_size or config.tensor_model_parallel_size
    if etp != want:
        raise ValueError(
            f"the expert-TP group has {etp} ranks but the model was built with "
            f"expert_tensor_parallel_size={want}; pass the model's own expt_tp group "
            "(pg_collection.expt_tp)"
        )
    return ep_group, expt_tp_group


def load_hf_weights(
    models: list[torch.nn.Module],
    record: ModelRecord,
    hf_tensors: Mapping[str, torch.Tensor],
    config: TransformerConfig,
    *,
    tp_rank: int,
    pp_rank: int,
    ep_rank: int = 0,
    etp_rank: int | None = None,
) -> None:
    """Copy full HF-named tensors into this rank's (possibly wrapped) model chunks.

    Routed experts: this EP rank's (``ep_rank``), split over expert TP at ``etp_rank`` (None:
    the TP rank, megatron's default). Every parameter of every chunk must be covered: a tensor
    the record does not produce is a ValueError, never left at its initial value.
    """
    tp_size = config.tensor_model_parallel_size
    etp_size = config.expert_tensor_parallel_size or tp_size
    chunks = model_chunks_of_rank(config, pp_rank, ep_rank)
    for model, chunk in zip(models, chunks, strict=True):
        params = chunk_parameters(model, record, chunk)
        shards = record.hf_to_megatron_shards(
            hf_tensors, tp_rank, tp_size, chunk, etp_rank=etp_rank, etp_size=etp_size
        )
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(shards[name])


def chunk_parameters(
    model: torch.nn.Module, record: ModelRecord, chunk: ModelChunk
) -> dict[str, torch.nn.Parameter]:
    """The parameters (and the persistent buffers the record names: a sigmoid router's
    ``expert_bias``) of one (possibly wrapped) model chunk by name; ValueError unless they are
    exactly the record's tensors of ``chunk`` (e.g. a record of the local spec for a model built
    with Transformer Engine's: build it with ``layer_spec=provider.layer_spec_kind(spec)``)."""
    module = unwrap_model(model)
    names = record.tensor_maps(chunk)
    params = dict(module.named_parameters())
    # The persistent buffers the record names (a sigmoid router's expert_bias) travel as
    # weights too: HF stores them, vLLM routes with them.
    params |= {name: buffer for name, buffer in module.named_buffers() if name in names}
    if set(params) != set(names):
        raise ValueError(
            f"record (layer_spec={record.layer_spec!r}) and model disagree on layers "
            f"{chunk.layers}: model only {sorted(set(params) - set(names))[:5]}, record only "
            f"{sorted(set(names) - set(params))[:5]}; build the record with the layer spec "
            "kind the model was built with (provider.layer_spec_kind)"
        )
    return params


class GatherBuffers:
    """Reusable buffers for the TP gathers and conversions of the weight stream.

    ``take`` hands out a tensor backed by a pooled buffer of the same element count, dtype
    and device whose storage nothing else references any more (every tensor and view handed
    out from it has been dropped: the consumer let go of its bucket and vLLM of its pending
    layer), or a new one. So a sync touches fresh memory only for what is in flight, not for
    the whole model (on CPU, first touch costs ~5x a copy into warm memory: 0.6 ms per MB
    here), and a yielded tensor is never overwritten while anyone holds it.

    ``limit_bytes`` bounds what the pool keeps: before allocating past it, free buffers are
    dropped, least recently used first (buffers in use are never dropped, so the pool may
    exceed the limit by what is in use). Keep one instance across syncs to start each sync
    with warm buffers (it then holds up to ``limit_bytes`` in between), or let each stream
    make its own.
    """

    def __init__(self, limit_bytes: int | None = None) -> None:
        self.limit_bytes = limit_bytes
        """What the pool keeps at most, in use or not (None: no bound)."""
        self._buffers: list[torch.Tensor] = []  # least recently handed out first

    def take(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of ``shape`` whose contents are undefined; nobody else references it."""
        numel = math.prod(shape)
        device = torch.device(device)
        for i, buffer in enumerate(self._buffers):
            if (
                buffer.numel() == numel
                and buffer.dtype == dtype
                and buffer.device == device
                and _storage_refs(buffer) <= 1
            ):
                self._buffers.append(self._buffers.pop(i))
                return buffer.view(shape)
        self._make_room(numel * dtype.itemsize)
        buffer = torch.empty(numel, dtype=dtype, device=device)
        self._buffers.append(buffer)
        return buffer.view(shape)

    def _make_room(self, nbytes: int) -> None:
        """Drop free buffers, least recently used first, until ``nbytes`` more fit the limit."""
        if self.limit_bytes is None:
            return
        excess = self.nbytes() + nbytes - self.limit_bytes
        kept = []
        for buffer in self._buffers:
            if excess > 0 and _storage_refs(buffer) <= 1:
                excess -= buffer.numel() * buffer.element_size()
            else:
                kept.append(buffer)
        self._buffers = kept

    def nbytes(self) -> int:
        """Bytes held by the pool, in use or not."""
        return sum(b.numel() * b.element_size() for b in self._buffers)


def _storage_refs(tensor: torch.Tensor) -> int:
    """References to ``tensor``'s storage from tensors, ``tensor`` included (a large number if
    this torch cannot say, so that the buffer is never reused)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return 1 << 30
    # The storage object made here to ask holds one reference of its own.
    return use_count(tensor.untyped_storage()._cdata) - 1


def gather_hf_weights(
    models: list[torch.nn.Module],
    record: ModelRecord,
    config: TransformerConfig,
    *,
    tp_group: dist.ProcessGroup | None,
    pp_rank: int,
    buffers: GatherBuffers | None = None,
    ep_group: dist.ProcessGroup | None = None,
    expt_tp_group: dist.ProcessGroup | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """This pipeline rank's weights as full HF-named tensors, gathered over ``tp_group``.

    MoE models: each routed expert's tensors are gathered over ``expt_tp_group`` (None: the
    TP group, when expert TP = TP), then over ``ep_group`` (None: EP = 1), one local expert
    slot at a time: local expert j's fc1 (or fc2) of every EP rank r, yielded as global
    experts ``r * local + j`` in EP-rank order. So what an expert gather holds is EP x one
    expert's tensor, never a whole layer's experts (``stream.py`` states the bound).

    Yields in the record's order, one Megatron tensor at a time (so at most one full tensor
    plus its shards is alive). Collective: every rank of the TP group must iterate to the end.

    Gathering to every rank, each split tensor is all-gathered into a pooled buffer
    (``buffers``; if None, a new pool that keeps no free buffer past the next allocation) and
    turned into HF tensors by views where the layout allows (the vocabulary trim: the embedding
    and LM head are views of the gathered buffer), by gathering its pieces apart (fc1's gate and
    up halves, each straight into its HF tensor), and by one copy into a pooled buffer where
    neither works (q/k/v out of the per-group fused rows, row-parallel shards side by side).
    Replicated tensors are the parameters themselves. A yielded tensor may share its storage
    with the others of the same Megatron tensor (q, k and v with one KV head): clone it to keep
    it apart.
    """
    ep_group, expt_tp_group = expert_groups(config, tp_group, ep_group, expt_tp_group)
    groups = _GatherGroups(tp_group, expt_tp_group, ep_group)
    yield from _all_gather_hf_weights(
        models, record, config, groups, pp_rank, buffers or GatherBuffers(0)
    )


def tp_gathers(
    models: list[torch.nn.Module],
    record: ModelRecord,
    config: TransformerConfig,
    *,
    pp_rank: int,
    ep_rank: int = 0,
) -> Iterator[tuple[str, TensorMap, torch.Tensor, ModelChunk]]:
    """(Megatron name, map, local tensor, chunk) of every tensor this pipeline (and EP) rank
    exports, in the stream's order (the bench replays its all-gathers); ``gather_pieces``
    tells what is all-gathered of each."""
    chunks = model_chunks_of_rank(config, pp_rank, ep_rank)
    for model, chunk in zip(models, chunks, strict=True):
        params = chunk_parameters(model, record, chunk)
        for name, m in record.tensor_maps(chunk).items():
            if record.exports(m):  # not a tied copy (the first stage exports it), nor MTP
                yield name, m, params[name].detach(), chunk


def gather_pieces(m: TensorMap, local: torch.Tensor, tp_size: int) -> list[torch.Tensor]:
    """The contiguous pieces of this rank's shard ``local`` that the stream all-gathers over
    TP, one ``all_gather_into_tensor`` each into a [tp_size * rows, ...] buffer, in order: none
    for replicated tensors or at TP = 1; fc1's gate and up halves apart (each gathers straight
    into its HF tensor); any other split tensor whole."""
    if tp_size == 1 or m.split is Split.REPLICATED:
        return []
    local = local.contiguous()
    if m.split is Split.GATE_UP:  # this rank's [gate_r; up_r]
        return list(local.chunk(2))
    return [local]


@dataclass(frozen=True)
class _GatherGroups:
    """The groups one model's gather runs over."""

    tp: dist.ProcessGroup | None
    expt_tp: dist.ProcessGroup | None
    ep: dist.ProcessGroup | None


def _all_gather_hf_weights(models, record, config, groups: _GatherGroups, pp_rank, buffers):
    """``gather_hf_weights`` to every rank of the TP (and EP) group, through ``buffers``."""
    ep_rank = 0 if groups.ep is None else dist.get_rank(groups.ep)
    for name, m, local, chunk in tp_gathers(
        models, record, config, pp_rank=pp_rank, ep_rank=ep_rank
    ):
        if m.expert is None:
            yield from _tp_gathered(record, name, m, local, chunk, groups.tp, buffers)
            continue
        named = _tp_gathered(record, name, m, local, chunk, groups.expt_tp, buffers)
        if chunk.ep_size == 1:
            yield from named
        else:
            yield from _ep_gathered(record, m, chunk, named, groups.ep, buffers)


def _gathered(piece: torch.Tensor, group, size: int, buffers: GatherBuffers) -> torch.Tensor:
    """Every rank's ``piece`` stacked along dim 0, in a pooled buffer."""
    full = buffers.take((size * piece.shape[0], *piece.shape[1:]), piece.dtype, piece.device)
    collectives.all_gather_into_tensor(full, piece.contiguous(), group)
    return full


def _tp_gathered(record, name, m, local, chunk, group, buffers):
    """The HF tensors of one Megatron tensor, its shards gathered over ``group`` (TP, or
    expert TP for a routed expert's tensor)."""
    size = 1 if group is None else dist.get_world_size(group)
    pieces = gather_pieces(m, local, size)
    if m.split is Split.REPLICATED:  # the parameter itself, as the record gives it
        yield from record.megatron_to_hf(name, [local] * size, chunk)
    elif not pieces:  # TP=1: converted out of the parameter
        yield from _hf_tensors(record, m, local, 1, buffers, owned=False)
    elif m.split is Split.GATE_UP:  # rank r's gate half is the r-th row block of HF gate
        for hf_name, piece in zip(m.hf_names, pieces, strict=True):
            yield hf_name, _gathered(piece, group, size, buffers)
    else:
        full = _gathered(pieces[0], group, size, buffers)
        yield from _hf_tensors(record, m, full, size, buffers, owned=True)


def _ep_gathered(record, m, chunk, named, ep_group, buffers):
    """This EP rank's HF tensors of one local expert slot (``named``, in ``m.hf_names``
    order) all-gathered over ``ep_group``, one HF tensor at a time: the i-th HF tensor of the
    same slot on every EP rank r (global expert ``r * local + j``), in EP-rank order, as views
    of one pooled [EP, ...] buffer. ``ep_hf_names`` lists this order."""
    ep_size = chunk.ep_size
    peers = record.ep_peers(m, chunk)
    for i, (_, tensor) in enumerate(named):
        full = _gathered(tensor, ep_group, ep_size, buffers).view(ep_size, *tensor.shape)
        del tensor  # the expert-TP result goes back to the pool
        for rank, peer in enumerate(peers):
            yield peer.hf_names[i], full[rank]


def ep_hf_names(record: ModelRecord, m: TensorMap, chunk: ModelChunk) -> list[str]:
    """The HF names the gather yields for Megatron tensor ``m`` of ``chunk`` over the whole
    EP group, in order: ``m.hf_names`` for a tensor that is not a routed expert's; for an
    expert slot, each HF tensor (gate, up; or down) of every EP rank's expert in turn."""
    if m.expert is None:
        return list(m.hf_names)
    peers = record.ep_peers(m, chunk)
    return [peer.hf_names[i] for i in range(len(m.hf_names)) for peer in peers]


def _hf_tensors(
    record: ModelRecord,
    m: TensorMap,
    full: torch.Tensor,
    tp_size: int,
    buffers: GatherBuffers,
    *,
    owned: bool,
) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of one split Megatron tensor from its TP shards stacked along dim 0
    (``full``: rank r's shard is the r-th of ``tp_size`` equal row blocks), as the record's
    ``megatron_to_hf`` computes them. ``owned``: ``full`` is a pooled buffer that views may
    keep (else it is a parameter, and every result is copied out of it)."""
    shapes = [record.hf_shape(hf_name) for hf_name in m.hf_names]
    rest = tuple(full.shape[1:])
    if m.split is Split.VOCAB:
        parts = [full[: shapes[0][0]]]
    elif m.split is Split.QKV:
        groups = record.config.num_key_value_heads
        fused = full.view(groups, -1, *rest)
        parts = fused.split([shape[0] // groups for shape in shapes], dim=1)
    elif m.split is Split.GATE_UP:
        halves = full.view(tp_size, 2, -1, *rest)
        parts = [halves[:, 0], halves[:, 1]]
    elif m.split is Split.COLUMN:  # the shards stacked are the HF tensor
        parts = [full]
    elif m.split is Split.ROW:  # the shards side by side along dim 1
        parts = [full.view(tp_size, -1, *rest).transpose(0, 1)]
    else:
        raise ValueError(f"{m.megatron_name}: no gather for split {m.split}")
    return [
        (hf_name, _as_hf(part, shape, buffers, owned))
        for hf_name, part, shape in zip(m.hf_names, parts, shapes, strict=True)
    ]


def _as_hf(
    part: torch.Tensor, shape: tuple[int, ...], buffers: GatherBuffers, owned: bool
) -> torch.Tensor:
    """``part`` as a tensor of ``shape``: a view when it is contiguous in a pooled buffer,
    else a copy into a pooled buffer."""
    if owned and part.is_contiguous():
        return part.view(shape)
    out = buffers.take(shape, part.dtype, part.device)
    out.view(part.shape).copy_(part)
    return out
