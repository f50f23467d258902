"""Worker: ``collectives.all_gather_varlen`` over the world and over a subgroup whose ranks
are not 0..k-1, with empty pieces and pieces of different lengths and dtypes; and
``all_to_all_varlen`` / ``all_to_all_flat`` with pieces of every length, empty ones too."""

from __future__ import annotations

import torch
import torch.distributed as dist

from vapo_megatron.parallel.collectives import (
    all_gather_varlen,
    all_to_all_flat,
    all_to_all_varlen,
)


def piece(rank: int, dtype: torch.dtype) -> torch.Tensor:
    n = (0, 5, 3, 7)[rank]
    return (torch.arange(n) + 100 * rank).to(dtype)


def message(src: int, dst: int) -> torch.Tensor:
    """What rank ``src`` sends rank ``dst``: (src + dst) % 3 values (none for some pairs, the
    rank's own piece included), each naming both ends."""
    return torch.arange((src + dst) % 3, dtype=torch.float32) + 10 * src + 1000 * dst


def check_all_to_all(rank: int, world: int) -> None:
    pieces = [message(rank, dst) for dst in range(world)]
    want = [message(src, rank) for src in range(world)]
    got = all_to_all_varlen(pieces, None)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (rank, got, want)
    flat = all_to_all_flat(torch.cat(pieces), [p.numel() for p in pieces], None)
    assert all(torch.equal(g, w) for g, w in zip(flat, want, strict=True)), (rank, flat, want)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for dtype in (torch.int32, torch.float32, torch.float64):
        got = all_gather_varlen(piece(rank, dtype), None)
        want = torch.cat([piece(r, dtype) for r in range(world)])
        assert got.dtype == dtype and torch.equal(got, want), (rank, got, want)
    members = [1, 3]  # a subgroup: group rank 0 is global rank 1
    sub = dist.new_group(members)
    if rank in members:
        got = all_gather_varlen(piece(rank, torch.float32), sub)
        want = torch.cat([piece(r, torch.float32) for r in members])
        assert torch.equal(got, want), (rank, got, want)
    check_all_to_all(rank, world)
    print(f"rank {rank}: varlen gather ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
