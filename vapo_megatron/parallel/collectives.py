"""Every collective the project's own code calls, each checking its tensors' device first.

Two kinds of group, two kinds of tensor (``docs/design.md``, "Devices"):
- a model's or the world's group runs on the default backend (NCCL on GPU, gloo on CPU) and
  takes tensors on the training device; NCCL rejects host tensors, and nothing on a CPU
  machine would show it, so each call here checks the device against the group's backend and
  raises a ValueError naming the call site's tensor and the fix;
- the *host group* (:func:`make_host_group`, gloo over every rank, made once per job) takes
  host tensors and Python objects: bookkeeping that belongs on the host (counts, timings,
  metric sums, trajectories until they travel as tensors) never stages on a GPU. Object
  collectives are refused on any group that is not gloo: on NCCL torch pickles into a buffer
  of world x the largest payload on the current GPU (torch #75619, #150798).

Code under ``vapo_megatron`` calls ``torch.distributed`` collectives only through this module
(``tests/distributed/test_placement.py`` records every call of a whole training step).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def make_host_group(timeout: timedelta | None = None) -> dist.ProcessGroup:
    """A gloo group over every rank for host-side exchange (collective: every rank calls it
    once, at the same point). ``timeout`` bounds each of its collectives (gloo's default is
    30 minutes)."""
    kwargs = {} if timeout is None else {"timeout": timeout}
    return dist.new_group(backend="gloo", **kwargs)


def group_backend(group: dist.ProcessGroup | None) -> str:
    """``group``'s backend as every check here reads it (``dist.get_backend``). The one place
    that reads it, so a CPU twin can report the default group as NCCL while it stays gloo
    (``tools/gpu_checks/twin.py``)."""
    return dist.get_backend(group)


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a tensor must live to take part in a collective of ``group``: the current CUDA
    device for NCCL, the host for gloo."""
    if group_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_device(tensor: torch.Tensor, group: dist.ProcessGroup | None, what: str) -> None:
    """ValueError unless ``tensor`` is on ``group``'s device (see :func:`group_device`)."""
    want = group_device(group)
    have = tensor.device
    if have.type != want.type or (want.index is not None and have.index != want.index):
        raise ValueError(
            f"{what}: a tensor on {have} went to a collective of a {group_backend(group)} "
            f"group, which needs {want}. Move it with .to({want}) (model and world groups), "
            "or use the host group for host-side bookkeeping"
        )


def _require_gloo(group: dist.ProcessGroup | None, what: str) -> None:
    backend = group_backend(group)
    if backend != "gloo":
        raise ValueError(
            f"{what}: object collectives run only on a gloo group (this one is {backend}); on "
            "NCCL they stage world x payload bytes on the GPU. Pass the host group "
            "(make_host_group)"
        )


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> None:
    """In-place all-reduce of ``tensor`` over ``group`` (nothing to do on one rank)."""
    check_device(tensor, group, "all_reduce")  # even alone: a 1-GPU run must catch it too
    if dist.get_world_size(group) == 1:
        return
    dist.all_reduce(tensor, op=op, group=group)


def all_gather_varlen(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's 1-D ``x`` [n_r] in rank order -> [sum n_r] on every rank.

    The lengths go first (one small all-gather), then each rank's piece is broadcast straight
    into its place in the result, on ``x``'s device: no padded copies and no per-rank pieces
    to concatenate, so the only memory beyond ``x`` is the result itself (a step's trajectories
    are gigabytes at 32B). Ranks with nothing to send cost no broadcast.
    """
    if x.dim() != 1:
        raise ValueError(f"all_gather_varlen takes 1-D tensors, got shape {tuple(x.shape)}")
    check_device(x, group, "all_gather_varlen")
    world = dist.get_world_size(group)
    if world == 1:
        return x.clone()
    length = torch.tensor([x.numel()], dtype=torch.long, device=x.device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n) for n in lengths]
    me = dist.get_rank(group)
    out = x.new_empty(sum(sizes))
    start = 0
    for rank, size in enumerate(sizes):
        piece = out[start : start + size]
        start += size
        if not size:
            continue
        if rank == me:
            piece.copy_(x)
        src = rank if group is None else dist.get_global_rank(group, rank)
        dist.broadcast(piece, src=src, group=group)
    return out


def all_to_all_varlen(
    pieces: list[torch.Tensor], group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """Piece k of ``pieces`` (1-D, one per rank of ``group``, in group-rank order, one dtype)
    to group rank k; returns the pieces every rank sent to this one, in rank order.

    The lengths go first (an all-to-all of one int64 per rank), then one
    ``all_to_all_single`` with uneven splits (gloo and NCCL both take it): each byte goes only
    to the rank it is for, unlike :func:`all_gather_varlen`. Used over the host group by the
    step's routed outputs (``step/advantage_exchange.py``).
    """
    world = dist.get_world_size(group)
    if len(pieces) != world:
        raise ValueError(f"all_to_all_varlen needs one piece per rank ({world}), got {len(pieces)}")
    for piece in pieces:
        check_device(piece, group, "all_to_all_varlen")
    if world == 1:
        return [pieces[0].clone()]
    return all_to_all_flat(torch.cat(pieces), [p.numel() for p in pieces], group)


def all_to_all_flat(
    x: torch.Tensor, sizes: Sequence[int], group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """:func:`all_to_all_varlen` of pieces the caller has laid end to end in ``x`` (1-D): the
    first ``sizes[0]`` elements go to group rank 0, the next ``sizes[1]`` to rank 1, and so on.
    Lets a caller write its pieces straight into one send buffer instead of making each piece
    and then a concatenated copy of them (the routed advantages, ``step/advantage_exchange.py``).
    Returns views of one receive buffer, one per rank, in rank order."""
    world = dist.get_world_size(group)
    if len(sizes) != world or sum(sizes) != x.numel() or x.dim() != 1:
        raise ValueError(
            f"all_to_all_flat needs a 1-D buffer and one size per rank ({world}) summing to its "
            f"length {x.numel()}, got shape {tuple(x.shape)} and sizes {list(sizes)}"
        )
    check_device(x, group, "all_to_all_flat")
    if world == 1:
        return [x.clone()]
    send = torch.tensor(list(sizes), dtype=torch.long, device=x.device)
    incoming = torch.empty_like(send)
    dist.all_to_all_single(incoming, send, group=group)
    recv = incoming.tolist()
    out = x.new_empty(sum(recv))
    dist.all_to_all_single(out, x, recv, list(sizes), group=group)
    return list(out.split(recv))


def all_gather(x: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Every rank's ``x`` (same shape everywhere), in rank order."""
    check_device(x, group, "all_gather")
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x.contiguous(), group=group)
    return out


def all_gather_into_tensor(
    out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup | None
) -> None:
    """Every rank's ``x`` stacked along dim 0 into ``out`` (the weight stream's TP gathers)."""
    check_device(x, group, "all_gather_into_tensor")
    check_device(out, group, "all_gather_into_tensor (output)")
    dist.all_gather_into_tensor(out, x, group=group)


def gather(
    x: torch.Tensor,
    out: list[torch.Tensor] | None,
    *,
    dst: int,
    group: dist.ProcessGroup | None,
) -> None:
    """``x`` of every rank into ``out`` on global rank ``dst`` (None elsewhere)."""
    check_device(x, group, "gather")
    for piece in out or ():
        check_device(piece, group, "gather (output)")
    dist.gather(x, out, dst=dst, group=group)


def broadcast(tensor: torch.Tensor, *, src: int, group: dist.ProcessGroup | None) -> None:
    """``tensor`` of global rank ``src`` into ``tensor`` on every rank of ``group``."""
    check_device(tensor, group, "broadcast")
    dist.broadcast(tensor, src=src, group=group)


def send(tensor: torch.Tensor, *, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Point-to-point send to global rank ``dst``."""
    check_device(tensor, group, "send")
    dist.send(tensor, dst=dst, group=group)


def recv(tensor: torch.Tensor, *, src: int, group: dist.ProcessGroup | None = None) -> None:
    """Point-to-point receive from global rank ``src`` into ``tensor``."""
    check_device(tensor, group, "recv")
    dist.recv(tensor, src=src, group=group)


def barrier(group: dist.ProcessGroup | None) -> None:
    """Wait for every rank of ``group`` (pass the host group: a gloo barrier needs no GPU and
    waits as long as the group's timeout)."""
    dist.barrier(group=group)


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order, on every rank (gloo groups only)."""
    _require_gloo(group, "all_gather_objects")
    out: list[Any] = [None] * dist.get_world_size(group)
    if len(out) == 1:
        return [obj]
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(value: Any, group: dist.ProcessGroup | None, *, group_src: int = 0) -> Any:
    """``value`` of the group's rank ``group_src`` on every rank (gloo groups only)."""
    _require_gloo(group, "broadcast_object")
    box = [value]
    dist.broadcast_object_list(box, group=group, group_src=group_src)
    return box[0]
