"""Gathers of uneven per-rank pieces: tensors of different lengths, and small Python objects."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def all_gather_varlen(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's 1-D ``x`` [n_r] in rank order -> [sum n_r] on every rank.

    Two collectives: the lengths, then the data padded to the longest piece.
    """
    if x.dim() != 1:
        raise ValueError(f"all_gather_varlen takes 1-D tensors, got shape {tuple(x.shape)}")
    world = dist.get_world_size(group)
    if world == 1:
        return x.clone()
    length = torch.tensor([x.numel()], dtype=torch.long, device=x.device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n) for n in lengths]
    padded = x.new_zeros(max(sizes))
    padded[: x.numel()] = x
    pieces = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded, group=group)
    return torch.cat([piece[:n] for piece, n in zip(pieces, sizes, strict=True)])


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order, on every rank."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
