"""Worker: one engine replica of vLLM TP 2 on 2 gloo ranks, whose second rank's engine returns
no routes (``RolloutSample.routes`` None: vLLM returns a replica's routes on its first rank
only, ``rollout/output_rank.py``). ``generate_and_grade`` must take the samples and their
routes from the first rank: every sample's routes kept in the first rank's ``RouteStore``,
equal to what its engine returned, in sample order, and nothing kept on the second rank.

Usage: python leader_routes_worker.py
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from tests.distributed.step.workers.route_gather_worker import SHAPE, RoutedEngine
from tests.distributed.step.workers.trajectory_gather_worker import NUM_PROMPTS, N, grade
from vapo_megatron.parallel import collectives
from vapo_megatron.step import rollout
from vapo_megatron.step.engine_routes import RouteStore
from vapo_megatron.step.rollout import RolloutStats, generate_and_grade


class SecondRankEngine(RoutedEngine):
    """The same samples as the first rank's engine (TP lockstep), without routes."""

    def generate(self, prompt_ids, **kwargs):
        out = super().generate(prompt_ids, **kwargs)
        for o in out:
            o.routes = None
        return out


class KeepingStore(RouteStore):
    """A ``RouteStore`` that also remembers each sample's routes as added."""

    def __init__(self, shape) -> None:
        super().__init__(shape)
        self.added: list[tuple[int, torch.Tensor]] = []

    def add(self, routes: torch.Tensor) -> int:
        first = super().add(routes)
        self.added.append((first, routes.clone()))
        return first


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == 2
    host = collectives.make_host_group()
    rollout.score_responses = grade
    prompts = [
        SimpleNamespace(
            token_ids=[10 + g, 3, 4][: 1 + g % 3],
            record=SimpleNamespace(index=100 + g, data_source="x", answer="y"),
        )
        for g in range(NUM_PROMPTS)
    ]
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "a" * len(ids))
    engine = RoutedEngine() if rank == 0 else SecondRankEngine()
    store = KeepingStore(SHAPE)
    got = generate_and_grade(
        engine, tokenizer, prompts, n=N, temperature=1.0, top_p=1.0, max_new_tokens=6,
        stop_token_ids=[0], seed=7, routing={}, grader_timeout_s=1.0, stats=RolloutStats(),
        replica=0, num_replicas=1, host_group=host, route_store=store,
    )  # fmt: skip
    expected = [
        o.routes
        for o in RoutedEngine().generate(
            [p.token_ids for p in prompts], n=N, seed=7, max_new_tokens=6
        )
    ]
    assert len(got) == len(expected) == NUM_PROMPTS * N
    assert got.route_at[:, 0].tolist() == [0] * len(expected)  # every sample's routes on rank 0
    assert (store.num_rows > 0) == (rank == 0), (rank, store.num_rows)
    if rank == 0:
        assert [first for first, _ in store.added] == got.route_at[:, 1].tolist()
        for (_, kept), want in zip(store.added, expected, strict=True):
            assert torch.equal(kept, want)
    else:
        assert store.added == []
    print(f"LEADER_ROUTES_OK rank {rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
