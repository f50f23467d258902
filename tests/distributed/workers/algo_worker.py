"""Worker: context-parallel GAE and sharding invariance of the losses, on gloo.

Usage: python algo_worker.py LAYOUTS  with LAYOUTS like "1x1,2x1,1x2" (DP x CP); every rank
runs every check in which it takes part and compares with the single-process reference, which
each rank computes itself from the same seeded data.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from vapo_megatron.algorithms.gae import gae_packed, gae_padded, length_adaptive_lambda
from vapo_megatron.algorithms.losses import policy_loss, positive_nll_loss, value_loss
from vapo_megatron.parallel.context_parallel import split_for_cp, split_packed_for_cp
from vapo_megatron.parallel.cp_gae import gae_context_parallel, gae_context_parallel_packed
from vapo_megatron.parallel.reductions import global_loss_normalisers, sum_metrics

torch.set_default_dtype(torch.float64)


def layout_groups(dp: int, cp: int):
    """Create (collectively, on every rank) the groups of a DP x CP layout on ranks [0, dp*cp).

    Returns (dp_rank, cp_rank, cp_group, dp_cp_group) or None for ranks outside the layout.
    CP is the inner dimension, as in Megatron: rank = dp_rank * cp + cp_rank.
    """
    rank = dist.get_rank()
    cp_groups = [dist.new_group(list(range(d * cp, (d + 1) * cp))) for d in range(dp)]
    dp_cp_group = dist.new_group(list(range(dp * cp)))
    if rank >= dp * cp:
        return None
    return rank // cp, rank % cp, cp_groups[rank // cp], dp_cp_group


def gae_batch():
    gen = torch.Generator().manual_seed(7)
    batch, length = 6, 48
    rewards = torch.randn(batch, length, generator=gen)
    values = torch.randn(batch, length, generator=gen)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[0, 30:40] = True  # the early chunks hold no response token
    mask[1, :] = True
    # row 2: no response token at all
    mask[3] = torch.rand(length, generator=gen) > 0.4  # several runs
    mask[4, 47] = True  # one token, in the last chunk
    mask[5, 5:20] = True
    lam = length_adaptive_lambda(mask.sum(1), 0.05)
    lam[1], lam[5] = 1.0, 0.0
    return rewards * mask, values, mask, lam  # GAE rejects rewards off the response


def check_cp_gae(cp: int) -> None:
    world = dist.get_world_size()
    groups = [dist.new_group(list(range(s, s + cp))) for s in range(0, world - cp + 1, cp)]
    rank = dist.get_rank()
    if rank >= len(groups) * cp:
        return
    group, cp_rank = groups[rank // cp], rank % cp
    rewards, values, mask, lam = gae_batch()
    for gamma in (1.0, 0.95):
        ref_adv, ref_ret = gae_padded(rewards, values, mask, lam, gamma)
        shard = [split_for_cp(x, cp, cp_rank) for x in (rewards, values, mask)]
        adv, ret = gae_context_parallel(*shard, lam, gamma, group)
        torch.testing.assert_close(adv, split_for_cp(ref_adv, cp, cp_rank), atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(ret, split_for_cp(ref_ret, cp, cp_rank), atol=1e-10, rtol=1e-10)
        # Packed: the same rows cut to uneven lengths (multiples of 2 * CP), laid end to end.
        lengths = torch.tensor([48, 8, 0, 40, 48, 24])
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        flat = [torch.cat([x[b, : lengths[b]] for b in range(6)]) for x in (rewards, values, mask)]
        ref_adv, ref_ret = gae_packed(*flat, cu, lam, gamma)
        shard = [split_packed_for_cp(x, cu, cp, cp_rank) for x in flat]
        adv, ret = gae_context_parallel_packed(*shard, cu, lam, gamma, group)
        torch.testing.assert_close(
            adv, split_packed_for_cp(ref_adv, cu, cp, cp_rank), atol=1e-10, rtol=1e-10
        )
        torch.testing.assert_close(
            ret, split_packed_for_cp(ref_ret, cu, cp, cp_rank), atol=1e-10, rtol=1e-10
        )
    print(f"rank {rank}: CP={cp} GAE equals full-sequence GAE, padded and packed")


def check_cp_gae_traces(cp: int) -> None:
    """check_cp_gae with truncated importance traces (V-trace with lambda, issue 42): the carry
    across ranks takes the chunks' per-token coefficients."""
    world = dist.get_world_size()
    groups = [dist.new_group(list(range(s, s + cp))) for s in range(0, world - cp + 1, cp)]
    rank = dist.get_rank()
    if rank >= len(groups) * cp:
        return
    group, cp_rank = groups[rank // cp], rank % cp
    rewards, values, mask, lam = gae_batch()
    gen = torch.Generator().manual_seed(8)
    ratios = torch.exp(0.6 * torch.randn(rewards.shape, generator=gen))  # some > 1.5, < 0.8
    traces = {"rho_bar": 1.5, "c_bar": 0.8}
    ref_adv, ref_ret = gae_padded(rewards, values, mask, lam, 0.95, ratios=ratios, **traces)
    shard = [split_for_cp(x, cp, cp_rank) for x in (rewards, values, mask, ratios)]
    adv, ret = gae_context_parallel(*shard[:3], lam, 0.95, group, ratios=shard[3], **traces)
    torch.testing.assert_close(adv, split_for_cp(ref_adv, cp, cp_rank), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ret, split_for_cp(ref_ret, cp, cp_rank), atol=1e-10, rtol=1e-10)
    lengths = torch.tensor([48, 8, 0, 40, 48, 24])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    flat = [
        torch.cat([x[b, : lengths[b]] for b in range(6)]) for x in (rewards, values, mask, ratios)
    ]
    ref_adv, ref_ret = gae_packed(*flat[:3], cu, lam, 0.95, ratios=flat[3], **traces)
    shard = [split_packed_for_cp(x, cu, cp, cp_rank) for x in flat]
    adv, ret = gae_context_parallel_packed(
        *shard[:3], cu, lam, 0.95, group, ratios=shard[3], **traces
    )
    for got, want in ((adv, ref_adv), (ret, ref_ret)):
        want = split_packed_for_cp(want, cu, cp, cp_rank)
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    print(f"rank {rank}: CP={cp} GAE with importance traces equals full-sequence GAE")


# ----- sharding invariance of the token-level losses -----

BATCH, LENGTH, FEATURES = 12, 24, 5


def invariance_data():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(BATCH, LENGTH, FEATURES, generator=gen)
    pos = torch.arange(LENGTH)[None]
    start = torch.randint(2, 10, (BATCH, 1), generator=gen)
    stop = start + torch.randint(1, LENGTH - 9, (BATCH, 1), generator=gen)
    mask = (pos >= start) & (pos < stop)
    mask[1] = pos[0] >= LENGTH - 3  # only the last chunk holds response tokens
    mask[9:] = False  # the last sequences have no response tokens (a whole rank at DP=4)
    correct = torch.randint(0, 2, (BATCH, 1), generator=gen).bool().expand(BATCH, LENGTH)
    old_logp = -torch.rand(BATCH, LENGTH, generator=gen) * 2
    advantages = torch.randn(BATCH, LENGTH, generator=gen)
    returns = torch.randn(BATCH, LENGTH, generator=gen)
    old_values = torch.randn(BATCH, LENGTH, generator=gen)
    seq_tokens = mask.sum(1, keepdim=True).expand(BATCH, LENGTH).double()
    return dict(
        x=x, mask=mask, positive=correct, old_logp=old_logp, advantages=advantages,
        returns=returns, old_values=old_values, seq_tokens=seq_tokens,
    )  # fmt: skip


def losses(params, d, norm):
    theta, phi = params
    logp = -F.softplus(d["x"] @ theta)  # a per-token log-prob from a shared parameter
    values = d["x"] @ phi
    pg, metrics = policy_loss(
        logp, d["old_logp"] + 0.3 * d["advantages"].tanh(), d["advantages"], d["mask"],
        eps_low=0.2, eps_high=0.28, dual_clip=3.0, aggregation="token-mean",
        num_tokens=norm.num_tokens,
    )  # fmt: skip
    pg_sample, _ = policy_loss(
        logp, d["old_logp"], d["advantages"], d["mask"], eps_low=0.2, eps_high=0.2,
        aggregation="seq-mean-token-mean", num_tokens=norm.num_tokens, num_seqs=norm.num_seqs,
        seq_num_tokens=d["seq_tokens"],
    )  # fmt: skip
    nll, _ = positive_nll_loss(
        logp, d["mask"], d["positive"], num_positive_tokens=norm.num_positive_tokens
    )
    vl, _ = value_loss(
        values,
        d["returns"],
        d["mask"],
        num_tokens=norm.num_tokens,
        old_values=d["old_values"],
        clip=0.2,
    )
    total = pg + 0.1 * nll + vl + 0.5 * pg_sample
    return total, metrics


def fresh_params():
    gen = torch.Generator().manual_seed(11)
    return [torch.randn(FEATURES, generator=gen).requires_grad_() for _ in range(2)]


def reference():
    d = invariance_data()
    norm = global_loss_normalisers(
        [d["mask"]], [d["positive"]], BATCH, dp_cp_group=None, cp_size=1, device=torch.device("cpu")
    )
    params = fresh_params()
    loss, metrics = losses(params, d, norm)
    loss.backward()
    return loss.detach(), [p.grad for p in params], {k: v.item() for k, v in metrics.items()}, norm


def check_invariance(dp: int, cp: int, micro: int, ref) -> None:
    placed = layout_groups(dp, cp)
    if placed is None:
        return
    dp_rank, cp_rank, cp_group, dp_cp_group = placed
    d = invariance_data()
    per_rank = BATCH // dp
    mine = {k: v[dp_rank * per_rank : (dp_rank + 1) * per_rank] for k, v in d.items()}
    micro_batches = []
    for i in range(micro):
        rows = slice(i * per_rank // micro, (i + 1) * per_rank // micro)
        micro_batches.append(
            {k: split_for_cp(v[rows], cp, cp_rank, dim=1) for k, v in mine.items()}
        )
    norm = global_loss_normalisers(
        [m["mask"] for m in micro_batches], [m["positive"] for m in micro_batches], per_rank,
        dp_cp_group=dp_cp_group, cp_size=cp, device=torch.device("cpu"),
    )  # fmt: skip
    params = fresh_params()
    loss_sum = torch.zeros(())
    metric_sum: dict[str, torch.Tensor] = {}
    for m in micro_batches:
        loss, metrics = losses(params, m, norm)
        loss.backward()
        loss_sum += loss.detach()
        for k, v in metrics.items():
            metric_sum[k] = metric_sum.get(k, 0) + v
    grads = torch.stack([p.grad for p in params])
    dist.all_reduce(grads, group=dp_cp_group)  # what DDP does, as a sum
    dist.all_reduce(loss_sum, group=dp_cp_group)
    metrics = sum_metrics(metric_sum, dp_cp_group)
    ref_loss, ref_grads, ref_metrics, ref_norm = ref
    assert norm.num_tokens == ref_norm.num_tokens and norm.num_seqs == ref_norm.num_seqs
    assert norm.num_positive_tokens == ref_norm.num_positive_tokens
    torch.testing.assert_close(loss_sum, ref_loss, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(grads, torch.stack(ref_grads), atol=1e-12, rtol=1e-12)
    for k, v in ref_metrics.items():
        assert abs(metrics[k] - v) < 1e-12, (k, metrics[k], v)
    print(f"rank {dist.get_rank()}: DP={dp} CP={cp} micro={micro}: loss, grads, metrics equal")


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    for cp in (2, 4):
        if cp <= world:
            check_cp_gae(cp)
            check_cp_gae_traces(cp)
    ref = reference()
    for layout in sys.argv[1].split(","):
        dp, cp = (int(v) for v in layout.split("x"))
        for micro in (1, 3):
            check_invariance(dp, cp, micro, ref)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
