"""A batch of graded trajectories from rollout rank 0 to every trainer rank over the bridge's
``samples`` group (the separate placement, ``step/remote_rollouts.py``), as host tensors.

One message: a header (int64), the metadata rows (float64 [S, len(META_FIELDS)]), rewards
(float64 [S]), versions (int64 [S]), prompt and response ids (int32), the engine's log-probs
(float32 [N]), where routing replay is on the engine's routes of every sample in sample order
(int16 [rows, layers, top_k]), and a JSON text of the batch's counts and the sampler's
position after it. Nothing is pickled.

MoE routes: the rollout side first gathers every sample's routes to all its ranks
(``gather_routes``); every trainer rank then holds the whole batch's routes in one store and
is their holder, so the step's route exchange sends none across ranks. That costs each
trainer rank the batch's routes in host memory (rows x layers x top_k x 2 bytes): fine at
the tiny scale, and docs/training.md says what it costs at scale.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import torch
import torch.distributed as dist

from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.parallel.placement import bridge_broadcast
from vapo_megatron.step.batching import gather_index
from vapo_megatron.step.engine_routes import EVERY_RANK, RouteStore
from vapo_megatron.step.rollout import RolloutStats
from vapo_megatron.step.rollout_queue import QueuedBatch
from vapo_megatron.step.trajectories import (
    Trajectories,
    empty_flat_fields,
    flat_fields,
    from_flat_fields,
)

HEADER = 10
"""[S, P, N, route rows, route layers, route top_k (0: no routes), JSON bytes, step, version,
0]."""


def send_batch(batch: QueuedBatch, info: dict, group: dist.ProcessGroup) -> None:
    """Broadcast ``batch`` (its routes made whole by ``gather_routes``) and ``info`` (JSON:
    the sampler's position, timings) from this rank, the group's rank 0."""
    t = batch.trajectories
    routes = None if t.route_store is None else t.route_store.parts[0]
    text = json.dumps({"stats": asdict(batch.stats), **info}).encode()
    layers, top_k = (0, 0) if routes is None else t.route_store.shape
    header = [
        len(t), t.prompts.values.numel(), t.responses.values.numel(),
        0 if routes is None else routes.shape[0], layers, top_k, len(text), batch.step,
        batch.version, 0,
    ]  # fmt: skip
    _bcast(torch.tensor(header, dtype=torch.long, device=HOST), group)
    if t.version is None:
        raise ValueError("a batch sent to the trainers must carry its samples' policy versions")
    for tensor in flat_fields(t).values():  # FLAT_FIELDS' order
        _bcast(tensor.contiguous(), group)
    if routes is not None:  # gloo has no int16: their bytes
        _bcast(routes.contiguous().view(-1).view(torch.uint8), group)
    _bcast(torch.frombuffer(bytearray(text), dtype=torch.uint8), group)


def recv_batch(group: dist.ProcessGroup) -> tuple[QueuedBatch, dict]:
    """The batch ``send_batch`` broadcasts and its ``info``; with routes, this rank holds them
    all (``route_at``'s holder ``EVERY_RANK``)."""
    header = torch.empty(HEADER, dtype=torch.long, device=HOST)
    _bcast(header, group)
    s, p, n, rows, layers, top_k, text_bytes, step, version, _ = header.tolist()
    fields = empty_flat_fields(s, p, n)
    for tensor in fields.values():
        _bcast(tensor, group)
    store = None
    if top_k:
        routes = torch.empty(rows, layers, top_k, dtype=torch.int16, device=HOST)
        _bcast(routes.view(-1).view(torch.uint8), group)
        store = RouteStore((layers, top_k))
        store.add(routes)
    text = torch.empty(text_bytes, dtype=torch.uint8, device=HOST)
    _bcast(text, group)
    trajectories = from_flat_fields(fields)
    if store is not None:
        first = trajectories.route_offsets()[:-1]
        route_at = torch.stack([torch.full_like(first, EVERY_RANK), first], dim=1)
        trajectories.route_at, trajectories.route_store = route_at, store
    info = json.loads(text.numpy().tobytes().decode())
    stats = RolloutStats(**info.pop("stats"))
    return QueuedBatch(step, version, trajectories, stats), info


def gather_routes(trajectories: Trajectories, host_group: dist.ProcessGroup) -> None:
    """Every sample's engine routes, in sample order, into one store on every rank of the
    rollout side (they stay on the replica that generated them until now); ``route_at`` then
    points into it on each rank. Collective over the rollout side's ``host_group``."""
    store = trajectories.route_store
    if store is None:
        return
    me = dist.get_rank(host_group)
    offsets = trajectories.route_offsets()
    counts = offsets.diff()
    holder = trajectories.route_at[:, 0]
    mine = (holder == me).nonzero().squeeze(1)
    firsts = trajectories.route_at[mine, 1].tolist()
    parts = [store.sample(f, int(counts[i])) for f, i in zip(firsts, mine.tolist(), strict=True)]
    width = store.shape[0] * store.shape[1]
    local = (
        torch.cat([x.reshape(-1) for x in parts])
        if parts
        else torch.zeros(0, dtype=torch.int16, device=HOST)
    )
    # gloo has no int16: the routes travel as their bytes.
    gathered = collectives.all_gather_varlen(local.view(torch.uint8), host_group)
    gathered = gathered.view(torch.int16).view(-1, *store.shape)
    # Rank order -> sample order: each rank's rows are its samples' rows, ascending.
    order = torch.cat(
        [(holder == r).nonzero().squeeze(1) for r in range(dist.get_world_size(host_group))]
    )
    whole = torch.empty(int(offsets[-1]), *store.shape, dtype=torch.int16, device=HOST)
    whole[gather_index(offsets, order)] = gathered
    assert gathered.numel() == int(offsets[-1]) * width, "every sample's routes gathered once"
    fresh = RouteStore(store.shape)
    fresh.add(whole)
    trajectories.route_store = fresh
    trajectories.route_at = torch.stack([torch.full_like(offsets[:-1], me), offsets[:-1]], dim=1)


def _bcast(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    if tensor.numel():
        bridge_broadcast(tensor, group, HOST)
