"""The engine's routed experts (routing replay of the policy): held where they were generated,
sent once per step to the policy ranks that train on each sample.

A sample's routes are int16 [prompt + response - 1, layers, top_k]: 768 bytes a token for
Qwen3-30B-A3B (48 layers, top 8), 1.5 KB for Qwen3-235B-A22B. Gathered to every rank with
the trajectories, a 32-rank 30B-A3B step of 8,192 samples (~70M tokens) would put ~50 GB on
each rank and move that much over the host group per rank. So the rollout gathers only where
each sample's routes sit (``Trajectories.route_at``: the holder's host-group rank, the first
row in its ``RouteStore``); the replica's first rank keeps its samples' routes in the step's
``RouteStore``; once the step's owners are known (``step_share``: the policy's DP rank of
each sample), one all-to-all over the host group sends each sample's routes from its holder
to every rank of the policy's DP replica that owns it (its TP, CP and pipeline ranks: each
packs the sample's rows). Per rank that is its DP share of the step's routes, no more.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.step.critic_routes import step_routes


class RouteStore:
    """This rank's part of the step's engine routes: the samples its rollout replica
    generated (on the replica's first rank; empty elsewhere), every sampling round's rows end
    to end."""

    def __init__(self, shape: tuple[int, int]) -> None:
        self.shape = tuple(shape)
        """(layers, top_k) of every row."""
        self.parts: list[torch.Tensor] = []
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
        self.num_rows += routes.shape[0]
        return start

    def rows(self) -> torch.Tensor:
        """Every kept row, [num_rows, layers, top_k] int16 (one buffer)."""
        if len(self.parts) != 1:
            joined = (
                torch.cat(self.parts)
                if self.parts
                else torch.zeros((0, *self.shape), dtype=torch.int16, device=HOST)
            )
            self.parts = [joined]
        return self.parts[0]


def routes_to_owners(
    route_at: torch.Tensor,
    row_counts: torch.Tensor,
    store: RouteStore,
    owners: Sequence[int],
    dp_rank: int,
    host_group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's samples' engine routes (the samples whose policy owner ``owners[i]`` is
    ``dp_rank``, this rank's DP rank in the policy), as the trainer carries routes: [T,
    layers, top_k] int16 with offsets [S + 1], 0 rows for the other samples.

    ``route_at`` [S, 2] int64: each sample's holder (host-group rank) and first row in the
    holder's ``store``; ``row_counts`` [S]: prompt + response - 1. Collective over
    ``host_group`` (every rank, the holders and the policy's ranks)."""
    world = dist.get_world_size(host_group)
    me = dist.get_rank(host_group)
    dp_of = torch.tensor([dp_rank], dtype=torch.long, device=HOST)
    rank_dp = torch.cat(collectives.all_gather(dp_of, host_group)).tolist()
    holder = route_at[:, 0].tolist()
    first = route_at[:, 1].tolist()
    counts = row_counts.tolist()
    row_bytes = store.shape[0] * store.shape[1] * 2
    # Samples in index order: both sides enumerate them alike.
    by_pair: dict[tuple[int, int], list[int]] = {}
    for i, (h, owner) in enumerate(zip(holder, owners, strict=True)):
        by_pair.setdefault((h, owner), []).append(i)
    rows = store.rows() if any(h == me for h in holder) else None
    pieces = []
    for dest in range(world):
        ids = by_pair.get((me, rank_dp[dest]), [])
        parts = [rows[first[i] : first[i] + counts[i]] for i in ids]
        data = (
            torch.cat(parts)
            if parts
            else torch.zeros((0, *store.shape), dtype=torch.int16, device=HOST)
        )
        pieces.append(data.reshape(-1).view(torch.uint8))  # gloo has no int16
    received = collectives.all_to_all_varlen(pieces, host_group)
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
            kept[i] = part.view(torch.int16).view(-1, *store.shape)
    return step_routes(kept, len(owners), store.shape)
