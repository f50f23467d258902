"""Worker: decoupled GAE on the critic's CP shards equals the flat path's, on gloo.

Usage: python cp_shard_gae_worker.py LAYOUTS  with LAYOUTS like "2x1,2x2,1x4" (DP x CP, CP
the inner dimension). Every rank builds the same seeded step (prompt and response lengths,
rewards, one value per response token), computes the flat path's advantages and returns over
the whole step, then packs its data-parallel share into micro-batches for its CP rank exactly
as the trainer does, fills the positions off the response with garbage values, runs
``gae_on_cp_shards`` and compares every response token it holds with the flat path's at its
flat_index. The ranks of a DP group together must cover every response token exactly once.
The "vtrace" rows make some samples stale (V-trace GAE, ``step/importance.py``) and hand the
policy's log-probs either with the micro-batches (one layout) or gathered (the routed path).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.step.advantages import gae_advantages, gae_on_cp_shards
from vapo_megatron.step.batching import (
    FLAT_INDEX,
    Ragged,
    build_samples,
    dp_share,
    micro_batches,
)
from vapo_megatron.step.importance import stale_traces

ATOL = 2e-5


def step_data(num: int):
    gen = torch.Generator().manual_seed(11)
    prompt_lengths = torch.randint(1, 9, (num,), generator=gen)
    response_lengths = torch.randint(1, 41, (num,), generator=gen)
    if num > 7:
        response_lengths[3] = 1  # one response token: the reward's token is also the first
        response_lengths[7] = 90  # longer than the token budget: a micro-batch of its own
    prompts = Ragged(
        torch.randint(3, 50, (int(prompt_lengths.sum()),), generator=gen),
        torch.nn.functional.pad(prompt_lengths.cumsum(0), (1, 0)),
    )
    offsets = torch.nn.functional.pad(response_lengths.cumsum(0), (1, 0))
    responses = Ragged(torch.randint(3, 50, (int(offsets[-1]),), generator=gen), offsets)
    rewards = torch.randn(num, generator=gen)
    values = torch.randn(int(offsets[-1]), generator=gen)
    return prompts, responses, rewards, values


def traces_for(algo: AlgoConfig, responses: Ragged, num: int):
    """Every other sample stale, with engine log-probs off the policy's by up to +-1 nat."""
    gen = torch.Generator().manual_seed(5)
    n = int(responses.offsets[-1])
    policy = -torch.rand(n, generator=gen) * 3
    engine = policy + (torch.rand(n, generator=gen) * 2 - 1)
    staleness = torch.arange(num) % 2
    traces = stale_traces(algo, engine, staleness, responses.offsets, monte_carlo=False)
    return traces, policy


def check(
    dp: int, cp: int, algo: AlgoConfig, name: str, num: int = 13, *, traced: str = ""
) -> None:
    rank = dist.get_rank()
    cp_groups = [dist.new_group(list(range(d * cp, (d + 1) * cp))) for d in range(dp)]
    layout_group = dist.new_group(list(range(dp * cp)))
    if rank >= dp * cp:
        return
    dp_rank, cp_rank = rank // cp, rank % cp
    prompts, responses, rewards, values = step_data(num)
    offsets = responses.offsets
    traces = policy_logprobs = ratios = None
    if traced:
        traces, policy_logprobs = traces_for(algo, responses, num)
        ratios = traces.ratios_at(torch.arange(int(offsets[-1])), policy_logprobs)
        assert (ratios != 1).any() and (ratios == 1).any(), "stale and fresh tokens both"
        if traced == "gathered":
            traces.policy_logprobs = policy_logprobs
    flat_adv, flat_ret, flat_lam = gae_advantages(algo, rewards, values, offsets, ratios=ratios)
    if traced:  # the check can fail: the traces move the advantages
        plain, _, _ = gae_advantages(algo, rewards, values, offsets)
        assert (plain - flat_adv).abs().max() > 1e-3

    token_counts = (prompts.lengths() + responses.lengths()).tolist()
    mine = dp_share(token_counts, dp, dp_rank)
    samples = build_samples(prompts, responses, mine, offsets)
    layout = ModelLayout(cp=cp)
    mbs = micro_batches(samples, layout, cp_rank=cp_rank, token_budget=64, field_names=[FLAT_INDEX])
    if num > 7 and dp_rank == 0 and len(mbs) < 3:
        raise AssertionError(f"the check needs several micro-batches, got {len(mbs)}")
    gen = torch.Generator().manual_seed(100 + rank)
    shard_values = []
    for mb in mbs:  # the critic's output: the token's value on the response, garbage elsewhere
        mask = mb.response_mask.reshape(-1)
        garbage = torch.randn(mask.numel(), generator=gen) * 100
        index = mb.fields[FLAT_INDEX].reshape(-1)
        shard_values.append(torch.where(mask, values[index], garbage)[None])
    logprobs = None
    if traced == "with_micro_batches":  # the policy's outputs, garbage off the response
        logprobs = [
            torch.where(mb.response_mask.reshape(-1), policy_logprobs[mb.fields[FLAT_INDEX].reshape(-1)], 7.0)
            for mb in mbs
        ]  # fmt: skip
    advantages, returns, lam = gae_on_cp_shards(
        algo, mbs, shard_values, torch.tensor(mine, dtype=torch.long, device=HOST), rewards, offsets,
        cp_groups[dp_rank] if cp > 1 else None, traces=traces, logprobs=logprobs,
    )  # fmt: skip
    torch.testing.assert_close(lam, flat_lam[mine], rtol=0, atol=0)
    seen = torch.zeros(int(offsets[-1]), dtype=torch.long)
    for mb, a, r in zip(mbs, advantages, returns, strict=True):
        mask = mb.response_mask.reshape(-1)
        index = mb.fields[FLAT_INDEX].reshape(-1)[mask]
        torch.testing.assert_close(a[mask], flat_adv[index], rtol=1e-5, atol=ATOL)
        torch.testing.assert_close(r[mask], flat_ret[index], rtol=1e-5, atol=ATOL)
        assert not a[~mask].any() and not r[~mask].any(), "nonzero advantage off the response"
        seen[index] += 1
    # Over the whole layout every response token is scored and advanced exactly once.
    collectives.all_reduce(seen, group=layout_group)
    assert bool((seen == 1).all()), f"tokens covered {seen.unique().tolist()} times"
    held = len(mine)
    print(
        f"DP={dp} CP={cp} {name}: shard GAE equals flat GAE on {len(mbs)} micro-batches, {held} samples"
    )


def main() -> None:
    dist.init_process_group("gloo")
    decoupled = AlgoConfig(lambda_critic=1.0, length_adaptive_alpha=0.05, gamma=1.0)
    discounted = AlgoConfig(
        lambda_critic=0.9, lambda_policy=0.8, length_adaptive_alpha=None, gamma=0.97
    )
    coupled = AlgoConfig(decoupled_gae=False, length_adaptive_alpha=0.05, gamma=0.99)
    for layout in sys.argv[1].split(","):
        dp, cp = (int(x) for x in layout.split("x"))
        for name, algo in (("vapo", decoupled), ("discounted", discounted), ("coupled", coupled)):
            check(dp, cp, algo, name)
            dist.barrier()
        for traced in ("with_micro_batches", "gathered"):
            check(dp, cp, decoupled, f"vtrace {traced}", traced=traced)
            dist.barrier()
    # Fewer samples than DP ranks: rank 3 scores none (one empty micro-batch).
    check(4, 1, decoupled, "3 samples", num=3)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
