"""Routed experts in the step's data (routing replay): where the trajectories' int16 routes sit
(``route_at`` into the holder's ``RouteStore``) follows their samples through selection and
concatenation, the rollout files carry none, and packing places each sample's routes on its
own positions of the packed row, split over CP as the tokens. The exchange to the policy's
owners is tested over gloo in tests/distributed/step/test_route_gather.py."""

import dataclasses

import pytest
import torch

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.data.packing import packed_positions
from vapo_megatron.step.batching import ROUTES, build_samples, micro_batches
from vapo_megatron.step.engine_routes import RouteStore
from vapo_megatron.step.rollout_store import load_rollouts, save_rollouts
from vapo_megatron.step.trajectories import Trajectories, concat

pytestmark = pytest.mark.unit

LAYERS, TOP_K = 3, 2
PROMPTS = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]
RESPONSES = [[11, 12], [13, 14, 15], [16], [17, 18, 19]]


def routes_of(i):
    """Sample i's routes [P + R - 1, layers, top_k]: entries that name the sample and row."""
    n = len(PROMPTS[i]) + len(RESPONSES[i]) - 1
    base = torch.arange(n * LAYERS * TOP_K, dtype=torch.int16).view(n, LAYERS, TOP_K)
    return base + 1000 * i


def all_routes():
    """(routes [T, layers, top_k], offsets [S + 1]) of every sample, end to end."""
    rows = [routes_of(i) for i in range(len(PROMPTS))]
    counts = torch.tensor([r.shape[0] for r in rows])
    return torch.cat(rows), torch.nn.functional.pad(counts.cumsum(0), (1, 0))


def trajectories():
    """The samples, their routes held in one store (rank 0), added in reverse order."""
    meta = [
        (i, i, len(p), len(r), False, 1.0, 1.0)
        for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True))
    ]
    store = RouteStore((LAYERS, TOP_K))
    first = {i: store.add(routes_of(i)) for i in reversed(range(len(PROMPTS)))}
    return Trajectories.from_rows(
        torch.tensor(meta, dtype=torch.float64),
        torch.tensor([t for p in PROMPTS for t in p], dtype=torch.int32),
        torch.tensor([t for r in RESPONSES for t in r], dtype=torch.int32),
        torch.zeros(sum(map(len, RESPONSES))),
        torch.tensor([(0, first[i]) for i in range(len(PROMPTS))]),
        store,
    )


def sample_routes(t, i):
    start = int(t.route_at[i, 1])
    count = int(t.route_offsets().diff()[i])
    return t.route_store.sample(start, count)


def test_routes_follow_selection_and_concat_not_files(tmp_path):
    t = trajectories()
    picked = t.select(torch.tensor([2, 0, 3]))
    for k, i in enumerate([2, 0, 3]):
        assert torch.equal(sample_routes(picked, k), routes_of(i))
    both = concat([picked, t.select(torch.tensor([1]))])
    assert torch.equal(sample_routes(both, 3), routes_of(1))
    save_rollouts(tmp_path, 1, t)
    back = load_rollouts(tmp_path, 1)
    assert back.route_at is None and back.route_store is None
    with pytest.raises(ValueError, match="route_at must be"):
        Trajectories.from_rows(
            t.meta_rows(), t.prompts.values, t.responses.values, t.rollout_logprobs,
            t.route_at[1:], t.route_store,
        )  # fmt: skip
    other = dataclasses.replace(t.select(torch.tensor([1])), route_store=RouteStore((1, 1)))
    with pytest.raises(ValueError, match="other stores"):
        concat([t, other])
    with pytest.raises(ValueError, match="int16"):
        RouteStore((LAYERS, TOP_K)).add(torch.zeros(2, LAYERS, TOP_K + 1, dtype=torch.int16))


@pytest.mark.parametrize("cp", [1, 2])
def test_packing_places_routes_on_their_positions(cp):
    t = trajectories()
    layout = ModelLayout(cp=cp)
    samples = build_samples(
        t.prompts, t.responses, [0, 1, 2, 3], t.responses.offsets,
        routes=all_routes(),
    )  # fmt: skip
    for cp_rank in range(cp):
        mbs = micro_batches(samples, layout, cp_rank=cp_rank, token_budget=64, field_names=[])
        (mb,) = mbs
        row = mb.fields[ROUTES][0]
        assert row.shape == (mb.tokens.shape[1], LAYERS, TOP_K) and row.dtype == torch.int16
        # Each position with a route holds its token's route: the sample and position are
        # recoverable from the entry (1000 * sample + (position * layers * top_k)).
        positions = packed_positions(mb, cp, cp_rank)[0]
        for pos in range(row.shape[0]):
            entry = int(row[pos, 0, 0])
            if entry < 0:
                continue
            sample, flat = divmod(entry, 1000)
            position = flat // (LAYERS * TOP_K)
            assert int(positions[pos]) == position
            tokens = PROMPTS[sample] + RESPONSES[sample]
            assert int(mb.tokens[0, pos]) == tokens[position]
        # Every token but each sequence's last (and no padding) has a route.
        have = int((row[:, 0, 0] >= 0).sum())
        if cp == 1:
            assert have == sum(len(p) + len(r) - 1 for p, r in zip(PROMPTS, RESPONSES, strict=True))
