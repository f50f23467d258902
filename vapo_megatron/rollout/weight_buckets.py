"""Group a stream of named tensors into byte-bounded buckets for the weight sync.

The trainer streams full HF-named tensors one at a time (gathered from its TP x PP
shards); the rollout engine loads them a bucket at a time. A bucket bounds how many
bytes are in flight per message, so the peak extra memory of a sync is about one bucket
instead of one model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

NamedTensor = tuple[str, torch.Tensor]


def iter_buckets(
    named_tensors: Iterable[NamedTensor],
    bucket_bytes: int,
    *,
    dtype: torch.dtype | None = None,
) -> Iterator[list[NamedTensor]]:
    """Yield consecutive runs of ``named_tensors`` whose sizes add up to at most ``bucket_bytes``.

    - Order is preserved: concatenating the buckets gives back the input sequence.
    - A tensor is never split. A tensor larger than ``bucket_bytes`` goes alone in its own
      bucket (so that bucket exceeds the bound); the bucket before it is closed first.
    - Empty input yields no bucket; no bucket is ever empty.
    - Sizes are ``numel * element_size`` of the tensor as it will be sent. With ``dtype``,
      floating-point tensors are cast to it first (e.g. fp32 master weights to a bf16
      engine, halving the bytes sent) and measured after the cast; integer and bool
      tensors are left as they are.
    - The input is consumed lazily: at most one bucket (plus the tensor that closes it)
      is held at a time, so a generator that gathers shards one tensor at a time keeps
      its memory bounded.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype or None, got {dtype}")
    bucket: list[NamedTensor] = []
    bucket_size = 0
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        size = tensor.numel() * tensor.element_size()
        if bucket and bucket_size + size > bucket_bytes:
            yield bucket
            bucket, bucket_size = [], 0
        bucket.append((name, tensor))
        bucket_size += size
    if bucket:
        yield bucket


def bucket_nbytes(bucket: list[NamedTensor]) -> int:
    """Bytes held by the tensors of one bucket."""
    return sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
