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
    plan: Iterable[NamedTensor] | None = None,
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
    - The input is consumed lazily. Without ``plan`` a bucket is closed by the tensor that
      does not fit, so that tensor is already produced (a generator has gathered it) while
      the bucket is held: one bucket plus one tensor. ``plan`` is the (name, tensor) of every
      item to come, in order, where only names, shapes and dtypes count (meta tensors will
      do): a bucket is then closed before the tensor that would not fit is pulled, so at most
      one bucket is held. The input must follow the plan item by item (names, shapes and
      dtypes, after the cast) and end with it (ValueError otherwise).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype or None, got {dtype}")
    if plan is not None:
        yield from _planned_buckets(iter(named_tensors), bucket_bytes, dtype, plan)
        return
    bucket: list[NamedTensor] = []
    bucket_size = 0
    for name, tensor in named_tensors:
        tensor = _as_sent(name, tensor, dtype)
        size = tensor.numel() * tensor.element_size()
        if bucket and bucket_size + size > bucket_bytes:
            yield bucket
            bucket, bucket_size = [], 0
        bucket.append((name, tensor))
        bucket_size += size
    if bucket:
        yield bucket


def _planned_buckets(items, bucket_bytes, dtype, plan):
    """``iter_buckets`` with the plan known: a bucket is yielded before the next item is pulled."""
    bucket: list[NamedTensor] = []
    bucket_size = 0
    for planned_name, planned in plan:
        size = planned.numel() * _sent_dtype(planned, dtype).itemsize
        if bucket and bucket_size + size > bucket_bytes:
            yield bucket
            bucket, bucket_size = [], 0
        got = next(items, None)
        if got is None:
            raise ValueError(
                f"the tensors ended before {planned_name!r}, which the plan lists next"
            )
        name, tensor = got
        tensor = _as_sent(name, tensor, dtype)
        want = (planned_name, tuple(planned.shape), _sent_dtype(planned, dtype))
        if (name, tuple(tensor.shape), tensor.dtype) != want:
            raise ValueError(
                f"got {name!r} {tuple(tensor.shape)} {tensor.dtype} where the plan lists "
                f"{want[0]!r} {want[1]} {want[2]}: the plan must list the tensors as they come"
            )
        bucket.append((name, tensor))
        bucket_size += size
    if bucket:
        yield bucket
    extra = next(items, None)
    if extra is not None:
        raise ValueError(f"{extra[0]!r} comes after the last tensor of the plan")


def _sent_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def _as_sent(name: str, tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    return tensor.to(_sent_dtype(tensor, dtype))


def bucket_nbytes(bucket: list[NamedTensor]) -> int:
    """Bytes held by the tensors of one bucket."""
    return sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
