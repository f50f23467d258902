"""Worker: ``generate_and_grade`` with routes on 2 gloo ranks (2 replicas): every rank gets
every sample's int16 routes [prompt + response - 1, layers, top_k] in group order (they
travel as bytes: gloo has no int16)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from tests.distributed.step.workers.trajectory_gather_worker import (
    NUM_PROMPTS,
    FakeEngine,
    N,
    grade,
)
from vapo_megatron.parallel import collectives
from vapo_megatron.step import rollout
from vapo_megatron.step.rollout import RolloutStats, generate_and_grade, replica_share

SHAPE = (3, 2)  # layers, top_k


def routes_for(prompt, response, j):
    rows = len(prompt) + len(response) - 1
    base = torch.arange(rows * SHAPE[0] * SHAPE[1], dtype=torch.int32).view(rows, *SHAPE)
    return (base + 300 * prompt[0] + 1000 * j - 20000).to(torch.int16)  # negatives too


class RoutedEngine(FakeEngine):
    route_shape = SHAPE

    def generate(self, prompt_ids, *, n, **kwargs):
        out = super().generate(prompt_ids, n=n, **kwargs)
        for k, o in enumerate(out):
            o.routes = routes_for(prompt_ids[o.prompt_index], o.response_token_ids, k % n)
        return out


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
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
    got = generate_and_grade(
        RoutedEngine(), tokenizer, prompts, n=N, temperature=1.0, top_p=1.0, max_new_tokens=6,
        stop_token_ids=[0], seed=rank, routing={}, grader_timeout_s=1.0, stats=RolloutStats(),
        replica=rank, num_replicas=2, host_group=host,
    )  # fmt: skip
    expected = []
    for replica in range(2):
        share = replica_share(NUM_PROMPTS, 2, replica)
        ids = [prompts[g].token_ids for g in share]
        for o in RoutedEngine().generate(ids, n=N, seed=replica, max_new_tokens=6):
            expected.append(o.routes)
    assert got.routes.dtype == torch.int16
    offsets = got.route_offsets()
    for i, routes in enumerate(expected):
        assert torch.equal(got.routes[int(offsets[i]) : int(offsets[i + 1])], routes), i
    print(f"ROUTE_GATHER_OK rank {rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
