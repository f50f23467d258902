"""The fixed schedule of ``rollout.lag`` k: step s trains on the batch the policy after update
s - 1 - k generated (steps count from 1, so k = 0 is today's: generated with the weights
of the step itself).

Colocated, step s syncs the engine (policy version s - 1), generates every batch up to step
s + k not yet generated (all of 1 .. 1 + k at the first step, one batch a step after), and
trains on the oldest. Batch t is sampled with step t's seeds and prompts drawn in target
order, so a run is reproducible from its seeds, and the samples are those the separate
placement's rollout ranks generate for the same schedule.

In-flight batches are checkpointed, not regenerated (the weights that generated them are
gone once the policy has moved): rank 0 saves the trajectories (every rank holds them), each
rank its own part of their MoE routes (routing replay), so kill -9 resume is exact.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vapo_megatron.parallel.devices import HOST
from vapo_megatron.step.engine_routes import RouteStore
from vapo_megatron.step.rollout import RolloutStats
from vapo_megatron.step.trajectories import Trajectories, flat_fields, from_flat_fields


@dataclass
class QueuedBatch:
    """One batch of graded trajectories waiting for the step that trains on it."""

    step: int
    """The step that trains on it."""
    version: int
    """The policy version that generated it (updates applied: the step it was made at - 1)."""
    trajectories: Trajectories
    stats: RolloutStats


Generate = Callable[[int], tuple[Trajectories, RolloutStats]]
"""Target step -> its graded trajectories (seeded by that step) and their counts."""


class RolloutQueue:
    """Batches generated ahead of the steps that train on them (``lag`` of them between
    steps)."""

    def __init__(self, lag: int) -> None:
        if lag < 0:
            raise ValueError(f"rollout.lag must be >= 0, got {lag}")
        self.lag = lag
        self.batches: deque[QueuedBatch] = deque()

    def take(
        self, step: int, last_step: int, generate: Generate
    ) -> tuple[QueuedBatch, list[RolloutStats]]:
        """Step ``step``'s batch, after generating (with the weights the engine holds now,
        version ``step - 1``) every batch up to ``min(step + lag, last_step)`` not yet made;
        also the counts of the batches generated in this call."""
        first = self.batches[-1].step + 1 if self.batches else step
        if self.batches and self.batches[0].step != step:
            raise RuntimeError(
                f"the rollout queue holds steps {[b.step for b in self.batches]} at step {step}:"
                " the schedule and the checkpoint disagree"
            )
        made = []
        for target in range(first, min(step + self.lag, last_step) + 1):
            trajectories, stats = generate(target)
            trajectories.version = torch.full(
                (len(trajectories),), step - 1, dtype=torch.long, device=HOST
            )
            made.append(stats)
            self.batches.append(QueuedBatch(target, step - 1, trajectories, stats))
        batch = self.batches.popleft()
        if batch.step != step:
            raise RuntimeError(f"the rollout queue gave step {batch.step}'s batch at step {step}")
        return batch, made

    def state_dict(self) -> list[dict]:
        """The in-flight batches' trajectories and counts (the same on every rank: rank 0's
        is saved), as plain tensors and numbers."""
        return [
            {
                "step": b.step, "version": b.version, "stats": dataclasses.asdict(b.stats),
                **flat_fields(b.trajectories), "route_at": b.trajectories.route_at,
            }
            for b in self.batches
        ]  # fmt: skip

    def rank_state(self) -> list[dict | None]:
        """This rank's part of the in-flight batches' MoE routes (None per batch without)."""
        return [_route_state(b.trajectories.route_store) for b in self.batches]

    def load_state_dict(self, state: list[dict], rank_state: list[dict | None] | None) -> None:
        """Restore ``state_dict`` and this rank's ``rank_state`` (None: no routes saved)."""
        self.batches.clear()
        for k, entry in enumerate(state):
            routes = None if rank_state is None else rank_state[k]
            trajectories = _trajectories(entry, routes)
            stats = RolloutStats(**entry["stats"])
            self.batches.append(QueuedBatch(entry["step"], entry["version"], trajectories, stats))


def _trajectories(entry: dict, routes: dict | None) -> Trajectories:
    store = None
    if entry["route_at"] is not None:
        if routes is None:
            raise ValueError(
                "the checkpoint's in-flight rollouts carry MoE routes, but this rank's part of "
                "them was not saved: resume with the world size and layout that saved it"
            )
        store = RouteStore(tuple(routes["shape"]))
        for part in routes["parts"]:
            store.add(part)
    return from_flat_fields(entry, entry["route_at"], store)


def _route_state(store: RouteStore | None) -> dict | None:
    if store is None:
        return None
    return {"shape": list(store.shape), "parts": list(store.parts)}
