"""The trainer's data plumbing on one process: data-parallel shares, micro-batches, the scoring
gather (positions and permutations), and the step's advantages."""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from vapo_megatron.algorithms.gae import gae_packed, length_adaptive_lambda
from vapo_megatron.algorithms.presets import algo_preset
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.data.packing import Sample
from vapo_megatron.step import advantages as adv
from vapo_megatron.step.batching import (
    FLAT_INDEX,
    build_samples,
    dp_share,
    micro_batches,
    response_offsets,
)
from vapo_megatron.step.losses import logprob_scoring_fn, value_scoring_fn
from vapo_megatron.step.outputs import score_flat
from vapo_megatron.step.token_sums import TokenSums

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield


def random_batch(n: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 50) for _ in range(rng.randrange(1, 6))] for _ in range(n)]
    responses = [[rng.randrange(1, 50) for _ in range(rng.randrange(1, 12))] for _ in range(n)]
    return prompts, responses


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_dp_share_covers_every_sample_once_and_balances(dp):
    counts = [random.Random(i).randrange(1, 100) for i in range(37)]
    shares = [dp_share(counts, dp, r) for r in range(dp)]
    assert sorted(i for s in shares for i in s) == list(range(37))
    loads = [sum(counts[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(counts)
    assert shares == [dp_share(counts, dp, r) for r in range(dp)]  # deterministic


@pytest.mark.parametrize(
    "layout, check",
    [
        (ModelLayout(), lambda lengths: True),
        (ModelLayout(pp=2), lambda lengths: len(set(lengths)) == 1),
        (ModelLayout(tp=2, sequence_parallel=True), lambda lengths: all(n % 2 == 0 for n in lengths)),
        (ModelLayout(cp=2), lambda lengths: all(n % 4 == 0 for n in lengths)),
    ],
    ids=["plain", "pp2", "sp_tp2", "cp2"],
)  # fmt: skip
def test_micro_batches_respect_budget_and_layout(layout, check):
    prompts, responses = random_batch(20, 0)
    samples = build_samples(
        prompts, responses, range(20), response_offsets([len(r) for r in responses])
    )
    mbs = micro_batches(samples, layout, cp_rank=0, token_budget=40, field_names=[FLAT_INDEX])
    assert len(mbs) > 1 and sum(mb.num_seqs for mb in mbs) == 20
    assert check([mb.seq_length for mb in mbs])
    # Every response token appears once, in the flat index field.
    total = sum(len(r) for r in responses)
    if layout.cp == 1:
        seen = torch.cat([mb.fields[FLAT_INDEX][mb.response_mask] for mb in mbs])
        assert sorted(seen.tolist()) == list(range(total))


@pytest.mark.parametrize("layout", [ModelLayout(), ModelLayout(cp=2), ModelLayout(pp=2)])
def test_empty_share_is_one_masked_micro_batch(layout):
    (mb,) = micro_batches(
        [], layout, cp_rank=0, token_budget=64, field_names=[FLAT_INDEX, "returns"]
    )
    assert not mb.response_mask.any() and mb.num_seqs == 0
    assert set(mb.fields) == {FLAT_INDEX, "returns"}


@dataclass
class FakeEngine:
    """Stands in for a ModelEngine: its 'model' outputs 0.5 * input token + 0.25 * label at
    each position, so the expected value of every response token is known."""

    layout: ModelLayout = ModelLayout()
    dp_size: int = 1
    dp_rank: int = 0
    cp_rank: int = 0
    tp_rank: int = 0
    is_last_stage: bool = True
    device = torch.device("cpu")
    groups = SimpleNamespace(world=None, host=None)

    def run(self, mbs, loss_fn, *, forward_only):
        assert forward_only
        return [
            loss_fn((0.5 * mb.tokens + 0.25 * mb.labels)[..., None].float(), mb)[1] for mb in mbs
        ]


def expected_values(prompts, responses):
    """V(s_t) is read at the token *before* response token t (the last prompt token for t=0)."""
    out = []
    for p, r in zip(prompts, responses, strict=True):
        before = [p[-1], *r[:-1]]
        out += [0.5 * b + 0.25 * y for b, y in zip(before, r, strict=True)]
    return torch.tensor(out)


@pytest.mark.parametrize("budget", [16, 1000])
def test_scoring_reads_the_position_before_each_token(budget):
    prompts, responses = random_batch(15, 1)
    flat = score_flat(
        FakeEngine(), prompts, responses, scoring_fn=value_scoring_fn(), output_key="values",
        token_budget=budget,
    )  # fmt: skip
    torch.testing.assert_close(flat, expected_values(prompts, responses))


def test_permuting_samples_permutes_every_result():
    """Values, advantages, returns and lambdas follow their sample through any reordering."""
    prompts, responses = random_batch(12, 2)
    rewards = [float(random.Random(i).choice([-1, 1])) for i in range(12)]
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0)).tolist()
    algo = algo_preset("vapo")

    def results(order):
        p, r = [prompts[i] for i in order], [responses[i] for i in order]
        values = score_flat(
            FakeEngine(), p, r, scoring_fn=value_scoring_fn(), output_key="values",
            token_budget=24,
        )  # fmt: skip
        offsets = response_offsets([len(x) for x in r])
        a, ret, lam = adv.gae_advantages(algo, [rewards[i] for i in order], values, offsets)
        per_sample = {}
        for k, i in enumerate(order):
            s = slice(int(offsets[k]), int(offsets[k + 1]))
            per_sample[i] = (values[s], a[s], ret[s], lam[k])
        return per_sample

    straight, shuffled = results(list(range(12))), results(perm)
    for i in range(12):
        for x, y in zip(straight[i], shuffled[i], strict=True):
            torch.testing.assert_close(x, y)


def test_gae_advantages_put_the_reward_at_the_last_token():
    values = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])
    offsets = torch.tensor([0, 3, 5])
    rewards = [1.0, -1.0]
    flat = adv.terminal_rewards(rewards, offsets)
    assert flat.tolist() == [0.0, 0.0, 1.0, 0.0, -1.0]
    algo = algo_preset("vapo")
    a, ret, lam = adv.gae_advantages(algo, rewards, values, offsets)
    lengths = torch.tensor([3, 2])
    torch.testing.assert_close(lam, length_adaptive_lambda(lengths, 0.05))
    ref_a, _ = gae_packed(flat, values, torch.ones(5, dtype=torch.bool), offsets, lam, 1.0)
    _, ref_ret = gae_packed(flat, values, torch.ones(5, dtype=torch.bool), offsets, 1.0, 1.0)
    torch.testing.assert_close(a, ref_a)
    torch.testing.assert_close(ret, ref_ret)
    # lambda_critic = gamma = 1: the return of every token is the sequence's reward.
    torch.testing.assert_close(ret, torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0]))
    with pytest.raises(ValueError, match="at least one response token"):
        adv.terminal_rewards([1.0], torch.tensor([0, 0]))


def test_group_advantages_broadcast_per_sample():
    algo = algo_preset("grpo", samples_per_prompt=2, prompts_per_step=2)
    offsets = torch.tensor([0, 2, 3, 4, 7])
    a = adv.group_advantages(algo, [1.0, -1.0, 1.0, 1.0], offsets)
    assert a[:2].eq(a[0]).all() and a[0] > 0 > a[2] and a[3:].eq(0).all()


def test_temperature_touches_log_probs_never_values():
    """slime #1928: the critic's values must not be divided by the rollout temperature."""
    from vapo_megatron.models.logprobs import VocabSlice

    sample = Sample(prompt=[1, 2], response=[3, 4])
    (mb,) = micro_batches([sample], ModelLayout(), cp_rank=0, token_budget=64, field_names=[])
    logits = torch.randn(1, mb.seq_length, 8)
    vocab = VocabSlice(None, 8)
    hot = logprob_scoring_fn(vocab, temperature=0.5)(logits, mb)[1]["logprobs"]
    cold = logprob_scoring_fn(vocab, temperature=1.0)(logits, mb)[1]["logprobs"]
    assert not torch.allclose(hot, cold)
    values = torch.randn(1, mb.seq_length, 1)
    torch.testing.assert_close(value_scoring_fn()(values, mb)[1]["values"], values.squeeze(-1))


def test_whiten():
    x = torch.tensor([1.0, 2.0, 3.0, 10.0])
    w = adv.whiten(x, TokenSums(None, None))
    assert abs(w.mean().item()) < 1e-6 and abs(w.std().item() - 1) < 1e-5
    # Only the counted tokens set the mean and std (the shard route's counting mask).
    counted = torch.tensor([True, True, True, False])
    w = adv.whiten(torch.tensor([1.0, 2.0, 3.0, 99.0]), TokenSums(counted, None))
    torch.testing.assert_close(w[:3], torch.tensor([-1.0, 0.0, 1.0]))
