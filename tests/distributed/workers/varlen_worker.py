"""Worker: ``collectives.all_gather_varlen`` over the world and over a subgroup whose ranks
are not 0..k-1, with empty pieces and pieces of different lengths and dtypes."""

from __future__ import annotations

import torch
import torch.distributed as dist

from vapo_megatron.parallel.collectives import all_gather_varlen


def piece(rank: int, dtype: torch.dtype) -> torch.Tensor:
    n = (0, 5, 3, 7)[rank]
    return (torch.arange(n) + 100 * rank).to(dtype)


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
    print(f"rank {rank}: varlen gather ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
