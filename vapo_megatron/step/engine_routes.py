"""The engine's routed experts (routing replay of the policy): held where they were generated,
sent once per step to the policy ranks that train on each sample.

A sample's routes are int16 [prompt + response - 1, layers, top_k]: 768 bytes a token for
Qwen3-30B-A3B (48 layers, top 8), 1.5 KB for Qwen3-235B-A22B. Gathered to every rank with
the trajectories, a 32-rank 30B-A3B step of 8,192 samples (~70M tokens) would put ~50 GB on
each rank and move that much over the host group per rank. So the rollout gathers only where
each sample's routes sit (``Trajectories.route_at``: the holder's host-group rank, the first
row in its ``RouteStore``); the replica's first rank keeps its samples' routes in the step's
``RouteStore``; once the step's owners are known (``step_share``: the policy's DP rank of
each sample), all-to-alls over the host group send each sample's routes from its holder to
the ranks of the policy's DP replica that owns it.

Who needs what. A rank's routers read only their own layers (``ModelRouterReplay.layers``:
under PP its stage's, with VPP its chunks'), so each rank gets the sample's rows over its
layers alone. Every TP and CP rank of a stage gets the sample's every row: under sequence
parallelism a TP rank's routers see its slice of the *packed* row, and a CP rank its chunks
of it, and where a sample falls in a row is decided per mini-batch when its micro-batches
are packed (each epoch shuffles them; under PP the row's padding moves the last sample's CP
chunks), not known here. Per rank that is its DP share of the step's routes over its layers.

Memory of a holder: its store, the send buffer of one *round* and what it receives. Round r
sends each sample to the r-th rank (in host-group order) of each stage of its owner's
replica, so a round's buffer holds each sample once, over the layers of all stages: at most
the store's bytes (``tp x cp`` rounds). The pieces are written straight into that buffer
(``collectives.all_to_all_flat``): no per-destination piece, no concatenated copy.
``planning/host.py::route_host_parts`` counts these bytes for the planner.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch
import torch.distributed as dist

from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.step.critic_routes import step_routes

EVERY_RANK = -1
"""``Trajectories.route_at`` holder of routes every rank holds in its own store (the separate
placement's trainers receive the whole batch's, ``step/trajectory_wire.py``)."""


class RouteStore:
    """This rank's part of the step's engine routes: the samples its rollout replica
    generated (on the replica's first rank; empty elsewhere), every sampling round's rows
    numbered end to end. Kept as added (no joined copy): ``sample`` reads one in place."""

    def __init__(self, shape: tuple[int, int]) -> None:
        self.shape = tuple(shape)
        """(layers, top_k) of every row."""
        self.parts: list[torch.Tensor] = []
        self.starts: list[int] = []
        """The first row of each of ``parts``."""
        self.num_rows = 0

    def add(self, routes: torch.Tensor) -> int:
        """Keep ``routes`` [rows, layers, top_k] int16; returns the row they start at."""
        if routes.dtype != torch.int16 or tuple(routes.shape[1:]) != self.shape:
            raise ValueError(
                f"routes must be int16 [rows, {self.shape[0]}, {self.shape[1]}], got "
                f"{routes.dtype} {tuple(routes.shape)}"
            )
        start = self.num_rows
        self.parts.append(routes)
        self.starts.append(start)
        self.num_rows += routes.shape[0]
        return start

    def sample(self, first: int, count: int) -> torch.Tensor:
        """Rows ``first`` to ``first + count`` [count, layers, top_k], a view of the routes
        ``add`` kept (one ``add`` holds them all: a sample's routes are added whole)."""
        k = bisect.bisect_right(self.starts, first) - 1
        if k < 0 or first + count > self.starts[k] + self.parts[k].shape[0]:
            raise ValueError(
                f"rows {first}..{first + count} of a store of {self.num_rows} rows are not "
                "the rows of one add(): route_at does not point into this store"
            )
        offset = first - self.starts[k]
        return self.parts[k][offset : offset + count]


def routes_to_owners(
    route_at: torch.Tensor,
    row_counts: torch.Tensor,
    store: RouteStore,
    owners: Sequence[int],
    dp_rank: int,
    layers: Sequence[int],
    host_group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's samples' engine routes (the samples whose policy owner ``owners[i]`` is
    ``dp_rank``, this rank's DP rank in the policy), as the trainer carries routes: [T,
    len(layers), top_k] int16 over ``layers`` (this rank's routers' global layers, in
    ``ModelRouterReplay.layers`` order) with offsets [S + 1], 0 rows for the other samples.

    ``route_at`` [S, 2] int64: each sample's holder (host-group rank, or ``EVERY_RANK``: each
    rank's own ``store`` holds every sample, the separate placement) and first row in the
    holder's ``store``; ``row_counts`` [S]: prompt + response - 1. Collective over
    ``host_group`` (every rank, the holders and the policy's ranks), except where every rank
    holds every sample: then nothing crosses ranks."""
    if bool((route_at[:, 0] == EVERY_RANK).all()):
        return local_routes(route_at, row_counts, store, owners, dp_rank, layers)
    me = dist.get_rank(host_group)
    ranks = collectives.all_gather_objects((dp_rank, tuple(layers)), host_group)
    for rank, (_, its_layers) in enumerate(ranks):
        check_layers(f"rank {rank}", its_layers, store)
    rounds = exchange_rounds(ranks)
    holder, first = route_at[:, 0].tolist(), route_at[:, 1].tolist()
    counts = row_counts.tolist()
    # Samples in index order: both sides enumerate them alike.
    by_pair: dict[tuple[int, int], list[int]] = {}
    for i, (h, owner) in enumerate(zip(holder, owners, strict=True)):
        by_pair.setdefault((h, owner), []).append(i)
    received: list[torch.Tensor] = []
    for r in range(max(rounds) + 1):
        dests = [d for d in range(len(ranks)) if rounds[d] == r]
        sizes = [0] * len(ranks)  # int16 elements to each rank
        for d in dests:
            rows = sum(counts[i] for i in by_pair.get((me, ranks[d][0]), []))
            sizes[d] = rows * len(ranks[d][1]) * store.shape[1]
        send = torch.empty(sum(sizes), dtype=torch.int16, device=HOST)
        start = 0
        for d, size in enumerate(sizes):
            if size:
                ids = by_pair[(me, ranks[d][0])]
                fill(send[start : start + size], store, ids, first, counts, ranks[d][1])
            start += size
        got = collectives.all_to_all_flat(  # as bytes: gloo has no int16
            send.view(torch.uint8), [2 * s for s in sizes], host_group
        )
        del send
        if r == rounds[me]:
            received = got
    shape = (len(layers), store.shape[1])
    kept = unpack(received, by_pair, dp_rank, counts, shape, me)
    return step_routes(kept, len(owners), shape)


def check_layers(who: str, layers: Sequence[int], store: RouteStore) -> None:
    """ValueError unless ``layers`` (what ``who`` asks for) are layers of the store's routes."""
    if not layers or not all(0 <= layer < store.shape[0] for layer in layers):
        raise ValueError(
            f"{who} asks for the routes of layers {list(layers)}; the engine's routes have "
            f"{store.shape[0]} layers"
        )


def local_routes(
    route_at: torch.Tensor,
    row_counts: torch.Tensor,
    store: RouteStore,
    owners: Sequence[int],
    dp_rank: int,
    layers: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``routes_to_owners`` where this rank's ``store`` holds every sample's routes."""
    check_layers("this rank", layers, store)
    index = torch.tensor(layers, dtype=torch.long, device=HOST)
    counts, first = row_counts.tolist(), route_at[:, 1].tolist()
    kept = {
        i: torch.index_select(store.sample(first[i], counts[i]), 1, index)
        for i, owner in enumerate(owners)
        if owner == dp_rank
    }
    return step_routes(kept, len(owners), (len(layers), store.shape[1]))


def exchange_rounds(ranks: Sequence[tuple[int, tuple[int, ...]]]) -> list[int]:
    """The round in which each host-group rank receives, from every rank's (policy DP rank,
    layers): its index among the ranks of its replica that read the same layers (a stage's
    TP and CP ranks), in host-group order. Round r's sends hold each sample once."""
    seen: dict[tuple[int, tuple[int, ...]], int] = {}
    out = []
    for key in ranks:
        out.append(seen.get(key, 0))
        seen[key] = out[-1] + 1
    return out


def fill(
    out: torch.Tensor,
    store: RouteStore,
    ids: Sequence[int],
    first: Sequence[int],
    counts: Sequence[int],
    layers: Sequence[int],
) -> None:
    """Write samples ``ids``' routes over ``layers`` end to end into ``out`` (1-D int16, a
    view of the send buffer): no copy of any sample on the way."""
    index = torch.tensor(layers, dtype=torch.long, device=HOST)
    width = len(layers) * store.shape[1]
    start = 0
    for i in ids:
        dst = out[start : start + counts[i] * width].view(counts[i], len(layers), store.shape[1])
        torch.index_select(store.sample(first[i], counts[i]), 1, index, out=dst)
        start += counts[i] * width
    assert start == out.numel(), (start, out.numel())


def unpack(
    received: Sequence[torch.Tensor],
    by_pair: dict[tuple[int, int], list[int]],
    dp_rank: int,
    counts: Sequence[int],
    shape: tuple[int, int],
    me: int,
) -> dict[int, torch.Tensor]:
    """Each owned sample's routes [rows, *shape] int16 (views of ``received``: the bytes
    each host-group rank sent here), checking each sender sent exactly its samples'."""
    row_bytes = shape[0] * shape[1] * 2
    kept: dict[int, torch.Tensor] = {}
    for src, data in enumerate(received):
        ids = by_pair.get((src, dp_rank), [])
        sizes = [counts[i] * row_bytes for i in ids]
        if sum(sizes) != data.numel():
            raise RuntimeError(
                f"rank {me} got {data.numel()} bytes of routes from rank {src}, expected "
                f"{sum(sizes)} for samples {ids[:8]}..."
            )
        for i, part in zip(ids, data.split(sizes), strict=True):
            kept[i] = part.view(torch.int16).view(counts[i], *shape)
    return kept
