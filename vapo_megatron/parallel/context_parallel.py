"""Megatron's load-balanced context-parallel layout, for tensors and packed sequences.

Each sequence (padded to a multiple of 2 * CP) is cut into 2 * CP equal chunks; rank r holds
chunks r and 2 * CP - 1 - r, in that order, so causal attention work is balanced. This is the
layout of ``megatron.core.utils.get_batch_on_this_cp_rank`` (dense) and of THD batches with
``cu_seqlens_padded`` (packed).
"""

from __future__ import annotations

import torch


def chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two global chunk indices held by ``cp_rank``."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def split_for_cp(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's share of ``x`` along ``dim`` (whose size must divide by 2 * cp_size)."""
    length = x.shape[dim]
    if length % (2 * cp_size) != 0:
        raise ValueError(
            f"sequence length {length} must divide by 2 * cp_size = {2 * cp_size}; pad it first"
        )
    chunks = x.chunk(2 * cp_size, dim=dim)
    first, second = chunk_ids(cp_size, cp_rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def merge_from_cp(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`split_for_cp`: ``shards[r]`` is rank r's share."""
    cp_size = len(shards)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for rank, shard in enumerate(shards):
        first, second = chunk_ids(cp_size, rank)
        chunks[first], chunks[second] = shard.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def split_packed_for_cp(
    x: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """This rank's tokens of packed ``x`` [N, ...]: per sequence, its two chunks, in order.

    cu_seqlens_padded: [S + 1] boundaries of the sequences padded to multiples of 2 * cp_size.
    """
    lengths = cu_seqlens_padded.diff()
    if (lengths % (2 * cp_size) != 0).any():
        raise ValueError(
            f"every padded sequence length must divide by 2 * cp_size = {2 * cp_size}, got "
            f"{lengths.tolist()}"
        )
    return torch.cat(
        [split_for_cp(seq, cp_size, cp_rank, dim=0) for seq in x.split(lengths.tolist(), dim=0)]
    )
