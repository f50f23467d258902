"""The step's trajectories as flat tensors: row selection, metadata rows, the dynamic-sampling
filter, reward shaping and the rollout files, each against plain Python lists."""

import random

import pytest
import torch

from vapo_megatron.algorithms.presets import algo_preset
from vapo_megatron.step.batching import Ragged, gather_index
from vapo_megatron.step.rollout import shape_rewards, varied_groups
from vapo_megatron.step.rollout_store import load_rollouts, save_rollouts
from vapo_megatron.step.trajectories import META_FIELDS, Trajectories

pytestmark = pytest.mark.unit


def random_rows(n, seed, empty_every=0):
    rng = random.Random(seed)
    rows = [[rng.randrange(1, 1000) for _ in range(rng.randrange(0, 9))] for _ in range(n)]
    if empty_every:
        for i in range(0, n, empty_every):
            rows[i] = []
    return rows


def ragged(rows, dtype=torch.int32):
    values = torch.tensor([x for r in rows for x in r], dtype=dtype)
    offsets = torch.nn.functional.pad(torch.tensor([len(r) for r in rows]).cumsum(0), (1, 0))
    return Ragged(values, offsets)


def random_trajectories(n, seed):
    rng = random.Random(seed)
    prompts, responses = random_rows(n, seed), random_rows(n, seed + 1, empty_every=5)
    logprobs = [[-rng.random() for _ in r] for r in responses]
    meta = [
        (i // 2, rng.randrange(100), len(p), len(r), rng.random() < 0.3, rng.choice([-1.0, 1.0]),
         float(rng.random() < 0.5))
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True))
    ]  # fmt: skip
    traj = Trajectories.from_rows(
        torch.tensor(meta, dtype=torch.float64),
        ragged(prompts).values,
        ragged(responses).values,
        torch.tensor([x for lp in logprobs for x in lp], dtype=torch.float32),
    )
    return traj, prompts, responses, logprobs, meta


def test_ragged_rows_and_selection_match_lists():
    rows = random_rows(23, 0, empty_every=4)
    flat = ragged(rows)
    assert len(flat) == 23 and [flat[i].tolist() for i in range(23)] == rows
    assert flat.lengths().tolist() == [len(r) for r in rows]
    pick = torch.tensor([5, 0, 22, 5, 4, 4, 13])
    chosen = flat.select(pick)
    assert [chosen[i].tolist() for i in range(len(pick))] == [rows[i] for i in pick.tolist()]
    assert gather_index(flat.offsets, torch.zeros(0, dtype=torch.long)).numel() == 0
    with pytest.raises(ValueError, match="offsets"):
        Ragged(torch.zeros(4), torch.tensor([0, 3]))


def test_trajectories_select_and_metadata_rows_round_trip():
    traj, prompts, responses, logprobs, meta = random_trajectories(17, 3)
    assert len(traj) == 17
    torch.testing.assert_close(traj.meta_rows(), torch.tensor(meta, dtype=torch.float64))
    assert META_FIELDS[0] == "group" and traj.reward.tolist() == traj.score.tolist()
    order = torch.tensor([16, 3, 3, 0, 9])
    sub = traj.select(order)
    for k, i in enumerate(order.tolist()):
        assert sub.prompts[k].tolist() == prompts[i] and sub.responses[k].tolist() == responses[i]
        lo, hi = int(sub.responses.offsets[k]), int(sub.responses.offsets[k + 1])
        torch.testing.assert_close(
            sub.rollout_logprobs[lo:hi], torch.tensor(logprobs[i], dtype=torch.float32)
        )
        assert sub.meta_rows()[k].tolist() == list(map(float, meta[i]))
    assert sub.responses.values.dtype == torch.int32


def test_varied_groups_keeps_groups_whose_accuracies_differ():
    acc = torch.tensor([1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 1], dtype=torch.float64)
    assert varied_groups(acc, 3).tolist() == [False, False, True, True]
    assert varied_groups(acc, 4).tolist() == [True, True, True]


def test_shape_rewards_adds_the_overlong_penalty_per_sample():
    traj, *_ = random_trajectories(9, 5)
    shape_rewards(traj, algo_preset("vapo"), max_new_tokens=8)
    assert torch.equal(traj.reward, traj.score)
    dapo = algo_preset("dapo")
    shape_rewards(traj, dapo.__class__(**{**vars(dapo), "overlong_buffer_len": 4}), 8)
    lengths = traj.responses.lengths().tolist()
    # DAPO: no penalty up to max - buffer tokens, then linear down to -1 at max.
    expected = [
        s + (min(0.0, (8 - 4 - n) / 4)) for s, n in zip(traj.score.tolist(), lengths, strict=True)
    ]
    torch.testing.assert_close(traj.reward, torch.tensor(expected, dtype=torch.float64))


def test_rollout_files_round_trip_and_read_the_earlier_format(tmp_path):
    traj, prompts, responses, logprobs, meta = random_trajectories(11, 7)
    traj.reward = traj.score + 0.5
    path = save_rollouts(tmp_path, 1, traj)
    # One plain dict per trajectory, its tokens views of one stored buffer (saved once).
    rows = torch.load(path, weights_only=True)
    assert len(rows) == 11 and rows[3]["response"].tolist() == responses[3]
    storages = {r["response"].untyped_storage().data_ptr() for r in rows}
    assert len(storages) == 1
    back = load_rollouts(tmp_path, 1)
    for name in (
        "rollout_logprobs",
        "group",
        "prompt_index",
        "truncated",
        "score",
        "acc",
        "reward",
    ):
        assert torch.equal(getattr(back, name), getattr(traj, name)), name
    assert torch.equal(back.responses.values, traj.responses.values)
    assert torch.equal(back.prompts.offsets, traj.prompts.offsets)
    # A file of one dict per trajectory (before trajectories were tensors).
    rows = [
        {"group": m[0], "prompt_index": m[1], "prompt": p, "response": r,
         "rollout_logprobs": lp, "truncated": m[4], "score": m[5], "acc": m[6], "reward": m[5] + 0.5}
        for m, p, r, lp in zip(meta, prompts, responses, logprobs, strict=True)
    ]  # fmt: skip
    torch.save(rows, tmp_path / "step_000002.pt")
    old = load_rollouts(tmp_path, 2)
    assert torch.equal(old.meta_rows(), traj.meta_rows())
    assert torch.equal(old.reward, traj.reward)
    assert torch.equal(old.rollout_logprobs, traj.rollout_logprobs)


def test_packing_takes_token_tensors_as_it_takes_lists():
    from vapo_megatron.data.packing import Sample, pack

    prompts, responses = random_rows(6, 11), random_rows(6, 12)
    prompts = [p or [1] for p in prompts]  # a sample needs a prompt token
    as_lists = [Sample(prompt=p, response=r) for p, r in zip(prompts, responses, strict=True)]
    flat_p, flat_r = ragged(prompts), ragged(responses)
    as_views = [Sample(prompt=flat_p[i], response=flat_r[i]) for i in range(6)]
    a, b = pack(as_lists, cp_size=2, cp_rank=1), pack(as_views, cp_size=2, cp_rank=1)
    for name in ("tokens", "labels", "response_mask"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
