"""GAE on context-parallel shards: each rank scans its own tokens; one small all-gather.

Each rank holds two chunks of every sequence (Megatron's load-balanced layout, see
``context_parallel.py``). It first runs GAE on each of its chunks as if the chunk ended the
sequence (zero carry). With c = gamma * lambda, the true advantage of a response token t in
chunk j is then

    A_t = A'_t + c^(n_after(t)) * carry_j,    carry_j = gamma * V_next + c * A_next,

where n_after(t) counts the chunk's response tokens after t, and V_next, A_next belong to the
first response token to the right of chunk j (0 at the end of the sequence). carry_j follows
from the chunks to the right alone, through three numbers per chunk (``CARRY_FIELDS``): its
response-token count, and the value and zero-carry advantage of its first response token. Those
are all-gathered (3 floats x 2 chunks per sequence and rank), and every rank runs the tiny
recurrence over the 2 * CP chunks. No sequence data crosses ranks.

lambda is per sequence and must come from the full sequence (e.g. the length-adaptive lambda
from the total response length), not from a rank's shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vapo_megatron.algorithms.gae import check_rewards_on_response, gae_padded
from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.context_parallel import chunk_ids

CARRY_FIELDS = ("count", "first_value", "first_zero_carry_advantage")


def _first_response_entry(x: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """x at the first true position of each row of mask [R, L]; 0 for rows without one."""
    first = mask.to(torch.uint8).argmax(1)
    return torch.where(count > 0, x.gather(1, first[:, None]).squeeze(1), 0)


def gae_context_parallel(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    lam: torch.Tensor | float,
    gamma: float,
    cp_group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE for this rank's shard of a padded batch.

    rewards, values, response_mask: [B, 2 * Lc], this rank's chunks r and 2 * CP - 1 - r of
    every row (as ``split_for_cp`` gives them); rewards must be 0 off the mask (else
    ValueError). lam: [B] (full-sequence lambdas) or a float.
    Returns (advantages, returns), each [B, 2 * Lc], equal to the full-sequence GAE's shards.
    """
    check_rewards_on_response(rewards, response_mask, "(row, column) of this rank's CP shard")
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)
    batch, local_len = rewards.shape
    if local_len % 2 != 0:
        raise ValueError(f"a CP shard holds two equal chunks per row; got odd length {local_len}")
    chunk_len = local_len // 2
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    lam = torch.as_tensor(lam, dtype=dtype, device=rewards.device).expand(batch)
    coef = gamma * lam

    # Zero-carry GAE of each local chunk, as rows [2B, Lc] (row 2b + i is chunk i of row b).
    mask = response_mask.bool().reshape(2 * batch, chunk_len)
    chunk_values = values.to(dtype).reshape(2 * batch, chunk_len)
    zero_carry, _ = gae_padded(
        rewards.reshape(2 * batch, chunk_len), chunk_values, mask, lam.repeat_interleave(2), gamma
    )
    count = mask.sum(1)
    summary = torch.stack(
        [
            count.to(dtype),
            _first_response_entry(chunk_values, mask, count),
            _first_response_entry(zero_carry, mask, count),
        ],
        dim=-1,
    ).view(batch, 2, len(CARRY_FIELDS))

    if cp_size > 1:
        gathered = collectives.all_gather(summary, cp_group)
    else:
        gathered = [summary]
    by_chunk = [None] * (2 * cp_size)
    for rank, rank_summary in enumerate(gathered):
        first, second = chunk_ids(cp_size, rank)
        by_chunk[first], by_chunk[second] = rank_summary[:, 0], rank_summary[:, 1]

    # Carry into each chunk from the right, over the 2 * CP chunks (not over tokens).
    carries = [None] * (2 * cp_size)
    carry = torch.zeros(batch, dtype=dtype, device=rewards.device)
    for j in range(2 * cp_size - 1, -1, -1):
        carries[j] = carry
        n, first_value, first_adv = by_chunk[j].unbind(-1)
        first_true_adv = first_adv + torch.pow(coef, (n - 1).clamp(min=0)) * carry
        carry = torch.where(n > 0, gamma * first_value + coef * first_true_adv, carry)

    mine = torch.stack([carries[j] for j in chunk_ids(cp_size, cp_rank)], dim=1)  # [B, 2]
    # Response tokens after each position (clamped: off-mask entries are discarded below).
    n_after = (count[:, None] - torch.cumsum(mask, dim=1)).clamp(min=0)
    correction = torch.pow(coef.repeat_interleave(2)[:, None], n_after.to(dtype)) * mine.reshape(
        -1, 1
    )
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE for this rank's tokens of a packed (THD) batch under context parallelism.

    rewards, values, response_mask: [N_local], each sequence's two chunks in order (as
    ``split_packed_for_cp`` gives them); cu_seqlens_padded: [S + 1] boundaries of the *full*
    padded sequences (multiples of 2 * CP), on any device; lam: [S] or a float. Rewards must
    be 0 off the mask (else ValueError). Returns (advantages, returns), each [N_local]. The
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
        dense(rewards), dense(values), dense(response_mask.bool()), lam, gamma, cp_group
    )
    return advantages.reshape(-1)[dest], returns.reshape(-1)[dest]
