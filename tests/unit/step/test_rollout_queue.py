"""The fixed schedule of rollout.lag (step/rollout_queue.py) and its checkpoint state."""

from __future__ import annotations

import pytest
import torch

from vapo_megatron.step.engine_routes import RouteStore
from vapo_megatron.step.rollout import RolloutStats
from vapo_megatron.step.rollout_queue import RolloutQueue
from vapo_megatron.step.trajectories import META_FIELDS, Trajectories


def batch(target: int, routes: bool = False) -> Trajectories:
    """Two samples whose tokens say which step's batch they are."""
    meta = torch.tensor(
        [[0, target, 2, 3, 0, 1.0, 1.0], [0, target, 2, 1, 1, -1.0, 0.0]], dtype=torch.float64
    )
    assert meta.shape[1] == len(META_FIELDS)
    store = at = None
    if routes:
        store = RouteStore((2, 1))
        at = torch.tensor([[0, store.add(torch.full((4, 2, 1), target, dtype=torch.int16))],
                           [0, store.add(torch.full((2, 2, 1), -target, dtype=torch.int16))]])  # fmt: skip
    return Trajectories.from_rows(
        meta, torch.full((4,), target, dtype=torch.int32), torch.full((4,), target, dtype=torch.int32),
        torch.full((4,), -0.5 * target), at, store,
    )  # fmt: skip


class Generator:
    def __init__(self, routes: bool = False):
        self.made: list[int] = []
        self.routes = routes

    def __call__(self, target: int):
        self.made.append(target)
        return batch(target, self.routes), RolloutStats(generate_seconds=1.0, reward_seconds=0.5)


@pytest.mark.parametrize("lag", [0, 1, 2, 4])
def test_step_s_trains_on_the_batch_of_version_s_minus_1_minus_lag(lag):
    queue, gen, steps = RolloutQueue(lag), Generator(), 6
    for step in range(1, steps + 1):
        before = len(gen.made)
        taken, made = queue.take(step, steps, gen)
        assert taken.step == step and int(taken.trajectories.prompt_index[0]) == step
        assert taken.version == max(0, step - 1 - lag)
        assert taken.trajectories.version.tolist() == [taken.version] * 2
        assert len(made) == len(gen.made) - before
        assert len(queue.batches) == min(lag, steps - step)
    assert gen.made == list(range(1, steps + 1)), "each batch made once, in target order"


def test_the_queue_round_trips_through_its_state_with_routes():
    queue, gen = RolloutQueue(2), Generator(routes=True)
    queue.take(1, 9, gen)
    state, ranks = queue.state_dict(), queue.rank_state()
    restored = RolloutQueue(2)
    restored.load_state_dict(state, ranks)
    for a, b in zip(queue.batches, restored.batches, strict=True):
        assert (a.step, a.version) == (b.step, b.version)
        ta, tb = a.trajectories, b.trajectories
        for name in ("group", "prompt_index", "truncated", "score", "acc", "reward", "version",
                     "rollout_logprobs", "route_at"):  # fmt: skip
            assert torch.equal(getattr(ta, name), getattr(tb, name)), name
        assert torch.equal(ta.responses.values, tb.responses.values)
        assert torch.equal(ta.route_store.sample(0, 4), tb.route_store.sample(0, 4))
        assert torch.equal(ta.route_store.sample(4, 2), tb.route_store.sample(4, 2))
    taken, _ = restored.take(2, 9, gen)
    assert taken.step == 2 and gen.made == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="world size and layout that saved it"):
        RolloutQueue(2).load_state_dict(state, None)


def test_a_queue_out_of_step_is_refused():
    queue, gen = RolloutQueue(1), Generator()
    queue.take(1, 5, gen)
    with pytest.raises(RuntimeError, match="schedule and the checkpoint disagree"):
        queue.take(3, 5, gen)
    with pytest.raises(ValueError, match="lag must be >= 0"):
        RolloutQueue(-1)
