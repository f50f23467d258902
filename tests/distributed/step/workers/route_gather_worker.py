"""Worker: the engine's routes (routing replay) stay on the rank that generated them and reach
the policy ranks that own each sample, on 2 or 4 gloo ranks.

``generate_and_grade`` with a ``RouteStore`` gathers only where each sample's routes sit (the
holder: its replica's first rank; with 4 ranks, 2 replicas of 2 ranks, the second rank of a
replica holds nothing); ``routes_to_owners`` then sends each sample's int16 routes [prompt +
response - 1, layers, top_k] (as bytes: gloo has no int16) to every rank whose policy DP rank
owns it, over the layers that rank's routers read: each rank must end with exactly its owned
samples' routes over its layers, equal to what the engine returned, and 0 rows for every other
sample. Policy layouts: DP = world (each rank its own share), DP 1 (every rank all samples),
PP2 x DP1 (stage layers [0, 2] and [1], as VPP interleaves them), and on 4 ranks TP2 x DP2
(ranks 0-1 DP 0, 2-3 DP 1: both TP ranks get their replica's samples), DP ranks crossing the
replicas (rank % 2) and PP2 x DP2. What each holder sends is recorded (``SendRecorder``): to
each rank exactly its samples' rows over its layers, in send buffers no larger than the
holder's store (one round per rank of a stage, written in place: no per-destination pieces
and no concatenated copy of them).

Usage: python route_gather_worker.py
"""

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
from vapo_megatron.step.engine_routes import RouteStore, routes_to_owners
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


class SendRecorder:
    """Records, while entered, what this rank's ``all_to_all_flat`` calls send (bytes to each
    host-group rank, each send buffer's bytes) and the bytes ``torch.cat`` makes."""

    def __enter__(self) -> SendRecorder:
        self.sent: dict[int, int] = {}
        self.buffers: list[int] = []
        self.cat_bytes = 0
        self.flat, self.cat = collectives.all_to_all_flat, torch.cat

        def flat(x, sizes, group):
            self.buffers.append(x.numel() * x.element_size())
            for dest, size in enumerate(sizes):
                self.sent[dest] = self.sent.get(dest, 0) + size * x.element_size()
            return self.flat(x, sizes, group)

        def cat(tensors, *args, **kwargs):
            out = self.cat(tensors, *args, **kwargs)
            self.cat_bytes += out.numel() * out.element_size()
            return out

        collectives.all_to_all_flat, torch.cat = flat, cat
        return self

    def __exit__(self, *exc) -> None:
        collectives.all_to_all_flat, torch.cat = self.flat, self.cat


def check_sends(seen, name, dp_rank, layers, holders, counts, owners, routes, host) -> None:
    """Each rank got from this one exactly its samples' rows over its own layers (the
    layers every rank reports), no send buffer exceeded this rank's store, and the only copy
    ``torch.cat`` made is the received routes' (put in sample order)."""
    rank = dist.get_rank(host)
    ranks = collectives.all_gather_objects((dp_rank, len(layers)), host)
    want = {}
    for dest, (dest_dp, num_layers) in enumerate(ranks):
        mine = zip(holders, owners, counts, strict=True)
        rows = sum(c for h, o, c in mine if h == rank and o == dest_dp)
        want[dest] = rows * num_layers * SHAPE[1] * 2
    assert seen.sent == want, (name, seen.sent, want)
    held = sum(c for h, c in zip(holders, counts, strict=True) if h == rank)
    store_bytes = held * SHAPE[0] * SHAPE[1] * 2
    assert max(seen.buffers) <= store_bytes, (name, seen.buffers, store_bytes)
    got_bytes = routes.numel() * routes.element_size()
    assert seen.cat_bytes <= got_bytes, (name, seen.cat_bytes, got_bytes)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    host = collectives.make_host_group()
    rollout.score_responses = grade
    num_replicas = 2
    replica = rank // (world // num_replicas)
    prompts = [
        SimpleNamespace(
            token_ids=[10 + g, 3, 4][: 1 + g % 3],
            record=SimpleNamespace(index=100 + g, data_source="x", answer="y"),
        )
        for g in range(NUM_PROMPTS)
    ]
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "a" * len(ids))
    store = RouteStore(SHAPE)
    got = generate_and_grade(
        RoutedEngine(), tokenizer, prompts, n=N, temperature=1.0, top_p=1.0, max_new_tokens=6,
        stop_token_ids=[0], seed=replica, routing={}, grader_timeout_s=1.0, stats=RolloutStats(),
        replica=replica, num_replicas=num_replicas, host_group=host, route_store=store,
    )  # fmt: skip
    expected, holders = [], []
    for r in range(num_replicas):
        share = replica_share(NUM_PROMPTS, num_replicas, r)
        ids = [prompts[g].token_ids for g in share]
        for o in RoutedEngine().generate(ids, n=N, seed=r, max_new_tokens=6):
            expected.append(o.routes)
            holders.append(r * (world // num_replicas))  # the replica's first rank
    assert got.route_at[:, 0].tolist() == holders
    holds = rank in holders
    assert (store.num_rows > 0) == holds, (rank, store.num_rows)  # nothing gathered elsewhere
    count = len(got)
    every = list(range(SHAPE[0]))
    layouts = {
        "dp=world": (rank, list(range(count)), world, every),
        "dp=1": (0, [0] * count, 1, every),  # both ranks read every layer: 2 rounds
        "pp2 dp1": (0, [0] * count, 1, [0, 2] if rank == 0 else [1]),  # VPP-like stages
    }
    if world == 4:
        layouts["tp2xdp2"] = (rank // 2, None, 2, every)
        layouts["dp crosses replicas"] = (rank % 2, None, 2, every)
        layouts["pp2xdp2"] = (rank // 2, None, 2, [0] if rank % 2 == 0 else [1, 2])
    counts = got.route_offsets().diff().tolist()
    for name, (dp_rank, owners, dp_size, layers) in layouts.items():
        owners = [(i * 7) % dp_size for i in range(count)] if owners is None else owners
        owners = [o % dp_size for o in owners]
        with SendRecorder() as seen:
            routes, offsets = routes_to_owners(
                got.route_at, got.route_offsets().diff(), got.route_store, owners, dp_rank,
                layers, host,
            )  # fmt: skip
        assert routes.dtype == torch.int16
        for i in range(count):
            mine = routes[int(offsets[i]) : int(offsets[i + 1])]
            if owners[i] == dp_rank:
                assert torch.equal(mine, expected[i][:, layers]), (name, i)
            else:
                assert mine.shape[0] == 0, (name, i)
        holders_of = got.route_at[:, 0].tolist()
        check_sends(seen, name, dp_rank, layers, holders_of, counts, owners, routes, host)
        owned = sum(1 for o in owners if o == dp_rank)
        print(f"rank {rank}: {name}: {owned} of {count} samples' routes, as generated")
    print(f"ROUTE_GATHER_OK rank {rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
