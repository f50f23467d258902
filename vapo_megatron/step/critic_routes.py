"""Routing replay of an MoE critic: the routes of its scoring pass, replayed in its updates.

The values that make the advantages come from the scoring pass; the critic's loss then moves
values computed again in each update's forward, after earlier mini-batches have moved the
router. With ``critic.routing_replay: scoring`` the critic's routers record their top-k in the
scoring pass (``ModelEngine.run(record_routes=True)``) and every update's forward (and its
recompute in the backward pass) replays them, so both passes route each token alike.

Recorded routes come out per micro-batch as the routers saw them: this CP rank's row, this TP
rank's slice of it under sequence parallelism, this pipeline stage's layers. An update packs
the same samples into other micro-batches, where a sample sits at another place in the row
(another TP slice under SP) and, with CP under a pipeline, in other CP chunks (every row is
padded to one length, which moves the last sequence's chunks). So each micro-batch's row is
made whole over the model's TP group (under SP) and CP group, on its device, and cut into
samples: sample i keeps [prompt + response, len(layers), top_k] int16 on the host over this
rank's layers (``ModelRouterReplay.layers``: under PP its stage's; no other stage's, which this
rank never replays). Samples stay with the
critic's DP rank that scored them, which is the rank that trains on them
(``scoring_pass.step_share``). They reach the update's micro-batches as the engine's routes
reach the policy's (``batching.route_row``, ``ModelRouterReplay.set_micro_batch_routes``).

Host memory: the critic's DP share of the step's tokens x its stage's layers x top_k x 2
bytes per rank (``planning/host.py::route_host_parts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from vapo_megatron.data.packing import MicroBatch
from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.context_parallel import split_packed_for_cp
from vapo_megatron.parallel.devices import HOST

if TYPE_CHECKING:
    from vapo_megatron.engine.model_engine import ModelEngine


def whole_rows(engine: ModelEngine, mbs: Sequence[MicroBatch]) -> list[torch.Tensor]:
    """Each micro-batch's recorded routes (``engine.recorded_routes``, after a
    ``run(record_routes=True)`` on ``mbs``) over its whole packed row: [seq_length,
    len(layers), top_k] int16 on the host, this rank's layers (``router_replay.layers``).
    Collective over the model's TP group (under SP) and CP group, on the model's device."""
    layout = engine.layout
    tp_group = engine.groups.parallel.tp
    cp_group = engine.groups.parallel.cp
    out = []
    for mb, local in zip(mbs, engine.recorded_routes, strict=True):
        if layout.sequence_parallel and layout.tp > 1:  # TP slices of this CP rank's row
            local = torch.cat(collectives.all_gather(local, tp_group))
        if layout.cp > 1:
            row_length = local.shape[0] * layout.cp
            cu_padded = mb.packed_seq_params.cu_seqlens_q_padded.to(engine.device, torch.long)
            positions = torch.arange(row_length, device=engine.device)
            row = torch.full(
                (row_length, *local.shape[1:]), -1, dtype=local.dtype, device=engine.device
            )
            for rank, part in enumerate(collectives.all_gather(local, cp_group)):
                row[split_packed_for_cp(positions, cu_padded, layout.cp, rank)] = part
            local = row
        out.append(local.to(HOST, torch.int16))
    return out


def keep_sample_routes(
    store: dict[int, torch.Tensor],
    mbs: Sequence[MicroBatch],
    ids: Sequence[int],
    rows: Sequence[torch.Tensor],
    token_counts: Sequence[int],
) -> None:
    """Cut ``whole_rows``' rows into their samples: ``store[i]`` = sample i's routes
    [token_counts[i], layers, top_k] (``ids``: the micro-batches' samples in packing order;
    ``token_counts``: prompt + response per sample of the step)."""
    first = 0
    for mb, row in zip(mbs, rows, strict=True):
        starts = mb.packed_seq_params.cu_seqlens_q_padded.tolist()
        for j, i in enumerate(ids[first : first + mb.num_seqs]):
            store[i] = row[starts[j] : starts[j] + token_counts[i]].clone()
        first += mb.num_seqs
    if first != len(ids):
        raise RuntimeError(f"micro-batches held {first} samples, expected {len(ids)}")


def step_routes(
    store: dict[int, torch.Tensor], num_samples: int, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept samples' routes as the trainer carries routes (``batching.build_samples``):
    [T, layers, top_k] int16 with offsets [S + 1]; samples not kept here have none (0 rows).
    ``shape``: (layers, top_k), the layers this rank's routers read."""
    counts = torch.zeros(num_samples, dtype=torch.long, device=HOST)
    for i, routes in store.items():
        counts[i] = routes.shape[0]
    offsets = torch.zeros(num_samples + 1, dtype=torch.long, device=HOST)
    offsets[1:] = counts.cumsum(0)
    ordered = [store[i] for i in sorted(store)]
    routes = (
        torch.cat(ordered) if ordered else torch.zeros((0, *shape), dtype=torch.int16, device=HOST)
    )
    return routes, offsets
