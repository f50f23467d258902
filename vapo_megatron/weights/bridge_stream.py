"""The policy's HF-named weight buckets from trainer rank 0 to the rollout ranks over a bridge
group (the separate placement, ``parallel/placement.py``): the same buckets the in-process
sync loads (``ModelEngine.hf_buckets``), one message per bucket.

A bucket travels as: a header (int64: tensor count, name bytes, payload bytes), the names
(UTF-8, newline-joined), one row per tensor (int64: dtype code, ndim, shape padded to
``MAX_DIMS``), and the tensors' bytes end to end in one uint8 buffer, each at an offset
aligned to ``ALIGN`` bytes so that the receiver's tensors are views of it. A header with a
count of -1 ends the stream. The payload travels on the group's device (a GPU under NCCL);
everything else on it too, as the group takes one device.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from vapo_megatron.parallel.devices import HOST
from vapo_megatron.parallel.placement import bridge_broadcast

MAX_DIMS = 8
ALIGN = 16
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn)  # fmt: skip
"""The dtypes a bucket may hold, by code (the index)."""


def send_buckets(
    buckets: Iterable[Sequence[tuple[str, torch.Tensor]]],
    group: dist.ProcessGroup,
    device: torch.device,
) -> tuple[int, int]:
    """Broadcast every bucket from this rank (the group's rank 0), then the end marker;
    returns (buckets, payload bytes). Collective over ``group`` with ``recv_buckets``."""
    count = num_bytes = 0
    for bucket in buckets:
        names = "\n".join(name for name, _ in bucket).encode()
        rows, offsets, total = _layout(bucket)
        payload = torch.empty(total, dtype=torch.uint8, device=device)
        for (_, tensor), at in zip(bucket, offsets, strict=True):
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            payload[at : at + flat.numel()].copy_(flat)
        header = torch.tensor([len(bucket), len(names), total], dtype=torch.long, device=device)
        bridge_broadcast(header, group, device)
        bridge_broadcast(
            torch.frombuffer(bytearray(names), dtype=torch.uint8).to(device), group, device
        )
        bridge_broadcast(rows.to(device), group, device)
        bridge_broadcast(payload, group, device)
        count, num_bytes = count + 1, num_bytes + total
    bridge_broadcast(torch.tensor([-1, 0, 0], dtype=torch.long, device=device), group, device)
    return count, num_bytes


def recv_buckets(
    group: dist.ProcessGroup, device: torch.device
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The buckets ``send_buckets`` broadcasts, one list of (name, tensor) at a time, each
    tensor a view of its bucket's buffer on ``device``, until the end marker. Consume it
    whole: the group's next operation must not start before the marker arrives."""
    while True:
        header = torch.empty(3, dtype=torch.long, device=device)
        bridge_broadcast(header, group, device)
        count, name_bytes, total = header.tolist()
        if count < 0:
            return
        names = torch.empty(name_bytes, dtype=torch.uint8, device=device)
        bridge_broadcast(names, group, device)
        rows = torch.empty(count, 2 + MAX_DIMS, dtype=torch.long, device=device)
        bridge_broadcast(rows, group, device)
        payload = torch.empty(total, dtype=torch.uint8, device=device)
        bridge_broadcast(payload, group, device)
        yield _unpack(names.cpu().numpy().tobytes().decode().split("\n"), rows.cpu(), payload)


def _layout(bucket: Sequence[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[int], int]:
    """(rows [n, 2 + MAX_DIMS] int64 on the host, each tensor's byte offset, payload bytes)."""
    rows = torch.zeros(len(bucket), 2 + MAX_DIMS, dtype=torch.long, device=HOST)
    offsets, at = [], 0
    for i, (name, tensor) in enumerate(bucket):
        if tensor.dtype not in DTYPES or tensor.dim() > MAX_DIMS or "\n" in name:
            raise ValueError(
                f"{name}: {tensor.dtype} with {tensor.dim()} dims cannot travel in a weight "
                f"bucket (dtypes {DTYPES}, at most {MAX_DIMS} dims, no newline in the name)"
            )
        rows[i, 0], rows[i, 1] = DTYPES.index(tensor.dtype), tensor.dim()
        rows[i, 2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.long, device=HOST)
        offsets.append(at)
        at += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    return rows, offsets, at


def _unpack(
    names: list[str], rows: torch.Tensor, payload: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    out, at = [], 0
    for name, row in zip(names, rows.tolist(), strict=True):
        dtype, ndim = DTYPES[row[0]], row[1]
        shape = row[2 : 2 + ndim]
        numel = 1
        for size in shape:
            numel *= size
        nbytes = numel * dtype.itemsize
        out.append((name, payload[at : at + nbytes].view(dtype).view(shape)))
        at += -(-nbytes // ALIGN) * ALIGN
    return out
