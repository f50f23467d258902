"""GAE on context-parallel shards: each rank scans its own tokens; one small all-gather.

Each rank holds two chunks of every sequence (Megatron's load-balanced layout, see
``context_parallel.py``). It first runs GAE on each of its chunks as if the chunk ended the
sequence (zero carry). With the per-token coefficient g_t = gamma * lambda * c_t and input
weight rho_t (c_t = rho_t = 1 without importance ratios; with them, the truncated traces of
``algorithms/gae.py``), the true advantage of a response token t in chunk j is then

    A_t = A'_t + P_t * (gamma * rho_last * V_next + g_last * A_next),
    P_t = prod of g_i over the chunk's response tokens i from t up to, not including, its last,

where "last" is the chunk's last response token, and V_next, A_next belong to the first
response token to the right of chunk j (0 at the end of the sequence). So chunk j's first
response token has A_first = A'_first + a_j * V_next + b_j * A_next with a_j = gamma * rho_last
* P_first and b_j = P_first * g_last (the product of all the chunk's coefficients): five
numbers per chunk (``CARRY_FIELDS``: its response-token count, V_first, A'_first, a_j, b_j) are
all-gathered (5 floats x 2 chunks per sequence and rank), and every rank runs that affine
recurrence over the 2 * CP chunks. No sequence data crosses ranks.

lambda is per sequence and must come from the full sequence (e.g. the length-adaptive lambda
from the total response length), not from a rank's shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vapo_megatron.algorithms.gae import (
    check_importance_ratios,
    check_rewards_on_response,
    gae_padded,
    importance_traces,
)
from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.context_parallel import chunk_ids

CARRY_FIELDS = (
    "count",
    "first_value",
    "first_zero_carry_advantage",
    "next_value_gain",
    "next_advantage_gain",
)


def _first_response_entry(x: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """x at the first true position of each row of mask [R, L]; 0 for rows without one."""
    first = mask.to(torch.uint8).argmax(1)
    return torch.where(count > 0, x.gather(1, first[:, None]).squeeze(1), 0)


def _last_response_index(mask: torch.Tensor) -> torch.Tensor:
    """[R]: the last true position of each row of mask [R, L] (0 for rows without one)."""
    return mask.shape[1] - 1 - mask.to(torch.uint8).flip(1).argmax(1)


def _coefficients(lam, gamma, ratios, rho_bar, c_bar, shape, dtype):
    """(g, rho), each [R, L] (maybe expanded): g_t = gamma * lambda * c_t and rho_t, from
    lam [R] and ratios [R, L] or None (then c_t = rho_t = 1)."""
    per_row = (gamma * lam)[:, None]
    if ratios is None:
        return per_row.expand(shape), torch.ones_like(per_row).expand(shape)
    rho, c = importance_traces(ratios, rho_bar, c_bar, dtype)
    return per_row * c, rho


def _products_to_last(coef: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """P [R, L] float64: the product of coef over each row's response tokens from t up to,
    not including, the row's last one. Taken as exp of a float64 reverse cumsum of logs:
    accurate at any chunk length (a running float32 product rounds at every token), and
    log 0 = -inf gives the exact 0 of lambda = 0."""
    logs = torch.where(mask, coef.to(torch.float64).log(), 0.0)
    logs.scatter_(1, _last_response_index(mask)[:, None], 0.0)
    return logs.flip(1).cumsum(1).flip(1).exp_()


def _next_of_each_chunk(by_chunk: list[torch.Tensor]) -> list[torch.Tensor]:
    """[B, 2] (V_next, A_next) right of each of the 2 * CP chunks, from their [B, 5] summaries
    (``CARRY_FIELDS``), by the affine recurrence over chunks (not over tokens)."""
    nexts = [None] * len(by_chunk)
    next_value = torch.zeros_like(by_chunk[0][:, 0])
    next_advantage = torch.zeros_like(next_value)
    for j in range(len(by_chunk) - 1, -1, -1):
        nexts[j] = torch.stack([next_value, next_advantage], dim=-1)
        count, first_value, first_adv, value_gain, advantage_gain = by_chunk[j].unbind(-1)
        first_true_adv = first_adv + value_gain * next_value + advantage_gain * next_advantage
        next_advantage = torch.where(count > 0, first_true_adv, next_advantage)
        next_value = torch.where(count > 0, first_value, next_value)
    return nexts


def gae_context_parallel(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    lam: torch.Tensor | float,
    gamma: float,
    cp_group: dist.ProcessGroup | None,
    *,
    ratios: torch.Tensor | None = None,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE for this rank's shard of a padded batch.

    rewards, values, response_mask: [B, 2 * Lc], this rank's chunks r and 2 * CP - 1 - r of
    every row (as ``split_for_cp`` gives them); rewards must be 0 off the mask (else
    ValueError). lam: [B] (full-sequence lambdas) or a float. ratios: None, or [B, 2 * Lc]
    pi_old / mu per token, sharded the same way (truncated importance traces with bars
    rho_bar, c_bar, as in ``gae_padded``).
    Returns (advantages, returns), each [B, 2 * Lc], equal to the full-sequence GAE's shards.
    """
    check_rewards_on_response(rewards, response_mask, "(row, column) of this rank's CP shard")
    check_importance_ratios(ratios, rewards.shape, rho_bar, c_bar)
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)
    batch, local_len = rewards.shape
    if local_len % 2 != 0:
        raise ValueError(f"a CP shard holds two equal chunks per row; got odd length {local_len}")
    rows, chunk_len = 2 * batch, local_len // 2
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    lam = torch.as_tensor(lam, dtype=dtype, device=rewards.device).expand(batch)
    lam = lam.repeat_interleave(2)  # [2B]: row 2b + i is chunk i of row b

    # Zero-carry GAE of each local chunk, as rows [2B, Lc].
    mask = response_mask.bool().reshape(rows, chunk_len)
    chunk_values = values.to(dtype).reshape(rows, chunk_len)
    chunk_ratios = None if ratios is None else ratios.reshape(rows, chunk_len)
    traces = {"ratios": chunk_ratios, "rho_bar": rho_bar, "c_bar": c_bar}
    zero_carry, _ = gae_padded(
        rewards.reshape(rows, chunk_len), chunk_values, mask, lam, gamma, **traces
    )
    coef, rho = _coefficients(lam, gamma, chunk_ratios, rho_bar, c_bar, mask.shape, dtype)
    products = _products_to_last(coef, mask)  # [2B, Lc] float64
    count = mask.sum(1)
    last = _last_response_index(mask)[:, None]
    coef_last, rho_last = coef.gather(1, last).squeeze(1), rho.gather(1, last).squeeze(1)
    products_first = _first_response_entry(products, mask, count).to(dtype)
    summary = torch.stack(
        [
            count.to(dtype),
            _first_response_entry(chunk_values, mask, count),
            _first_response_entry(zero_carry, mask, count),
            gamma * rho_last * products_first,
            products_first * coef_last,
        ],
        dim=-1,
    ).view(batch, 2, len(CARRY_FIELDS))

    gathered = collectives.all_gather(summary, cp_group) if cp_size > 1 else [summary]
    by_chunk = [None] * (2 * cp_size)
    for rank, rank_summary in enumerate(gathered):
        first, second = chunk_ids(cp_size, rank)
        by_chunk[first], by_chunk[second] = rank_summary[:, 0], rank_summary[:, 1]
    nexts = _next_of_each_chunk(by_chunk)
    mine = torch.stack([nexts[j] for j in chunk_ids(cp_size, cp_rank)], dim=1)  # [B, 2, 2]
    next_value, next_advantage = mine.reshape(rows, 2).unbind(-1)
    bootstrap = gamma * rho_last * next_value + coef_last * next_advantage  # [2B]
    correction = products.to(dtype).mul_(bootstrap[:, None])
    advantages = (zero_carry + correction).masked_fill_(~mask, 0)
    returns = (advantages + chunk_values).masked_fill_(~mask, 0)
    return advantages.view(batch, local_len), returns.view(batch, local_len)


def gae_context_parallel_packed(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    lam: torch.Tensor | float,
    gamma: float,
    cp_group: dist.ProcessGroup | None,
    *,
    ratios: torch.Tensor | None = None,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE for this rank's tokens of a packed (THD) batch under context parallelism.

    rewards, values, response_mask: [N_local], each sequence's two chunks in order (as
    ``split_packed_for_cp`` gives them); cu_seqlens_padded: [S + 1] boundaries of the *full*
    padded sequences (multiples of 2 * CP), on any device; lam: [S] or a float; ratios: None
    or [N_local] pi_old / mu per token, laid out as the rewards (truncated importance traces
    with bars rho_bar, c_bar). Rewards must be 0 off the mask (else ValueError). Returns (advantages, returns), each [N_local]. The
    chunks are laid into dense rows [S, 2 * Lc_max] (shorter chunks padded with masked tokens,
    which GAE skips) and handed to :func:`gae_context_parallel`.
    """
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    chunk_lens = cu_seqlens_padded.to(rewards.device).diff() // (2 * cp_size)  # [S]
    num_seqs, width = chunk_lens.numel(), int(chunk_lens.max()) if chunk_lens.numel() else 0
    if int(chunk_lens.sum()) * 2 != rewards.numel():
        raise ValueError(
            f"this rank holds {rewards.numel()} tokens, but cu_seqlens_padded "
            f"{cu_seqlens_padded.tolist()} at CP={cp_size} gives {int(chunk_lens.sum()) * 2}"
        )
    check_rewards_on_response(rewards, response_mask, "token of this rank's packed CP shard")
    check_importance_ratios(ratios, rewards.shape, rho_bar, c_bar)  # before the dense layout
    # Destination of each local token in the dense [S, 2, width] layout.
    device = rewards.device
    seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), 2 * chunk_lens)
    offset_in_seq = torch.arange(rewards.numel(), device=device) - torch.repeat_interleave(
        torch.cumsum(2 * chunk_lens, 0) - 2 * chunk_lens, 2 * chunk_lens
    )
    half = (offset_in_seq >= chunk_lens[seq]).long()
    dest = seq * 2 * width + half * width + offset_in_seq - half * chunk_lens[seq]

    def dense(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(num_seqs * 2 * width)
        out[dest] = x
        return out.view(num_seqs, 2 * width)

    advantages, returns = gae_context_parallel(
        dense(rewards), dense(values), dense(response_mask.bool()), lam, gamma, cp_group,
        ratios=None if ratios is None else dense(ratios), rho_bar=rho_bar, c_bar=c_bar,
    )  # fmt: skip
    return advantages.reshape(-1)[dest], returns.reshape(-1)[dest]
