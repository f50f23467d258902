"""Run megatron-core 0.16.1's MoE layer (router, all-to-all dispatcher, experts) on CPU.

``apply_moe_cpu_shim()`` does nothing when CUDA is available; without it, on top of
``cpu_shim.apply_cpu_shim`` (which ``initialize_cpu_process_group`` applies), it fixes the three
places where megatron's MoE path assumes a GPU (paths under ``megatron/core/transformer/moe/``):

- ``moe_utils.py`` imports ``te_general_gemm`` from Transformer Engine inside a ``try`` and
  reads the module global in ``RouterGatingLinearFunction`` (the router's gating linear) even
  when the import failed: NameError. Set to None, megatron takes its plain ``torch.mm`` path.
- ``token_dispatcher.py`` ``MoEAlltoAllTokenDispatcher`` copies the split sizes device-to-host
  on a side stream (``torch.cuda.Stream()`` in ``__init__``, ``torch.cuda.stream``,
  ``current_stream``, ``wait_stream``, ``record_event`` and ``Event.synchronize`` in
  ``_maybe_dtoh_and_synchronize``). The module gets a view of torch whose ``cuda`` has
  stand-ins that do nothing: on CPU every tensor is already on the host and in order.
- The same copy goes through ``moe_utils.maybe_move_tensor_to_cpu``, which converts only CUDA
  tensors; on CPU the split sizes stayed tensors and ``all_to_all_single`` refused them
  ("incompatible function arguments"). The dispatcher's copy of that name also turns CPU
  tensors into numpy arrays when asked (``as_numpy``), as the GPU path hands them on.

- With expert TP > 1 the dispatcher all-gathers (and, backward, reduce-scatters) tokens over
  the expert-TP group in uneven splits (``dispatch_postprocess``:
  ``gather_from_sequence_parallel_region(..., output_split_sizes=...)``), which
  ``tensor_parallel/mappings.py`` ``_gather_along_first_dim`` / ``_reduce_scatter_along_first_dim``
  do with ``all_gather`` / ``reduce_scatter`` over a list of differently sized tensors: NCCL
  takes that, gloo does not ("invalid tensor size"). Their uneven branches are replaced by
  the same result from even collectives (gather padded to the largest split, then cut; sum
  everything, then keep this rank's split); the even branches are megatron's own.

gloo implements ``all_to_all_single`` with explicit split sizes, so with these the alltoall
dispatcher is the same code path on CPU as on GPU (``tests/distributed/models``' EP tests).
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch

_applied = False


def apply_moe_cpu_shim() -> bool:
    """Patch megatron's MoE modules for CPU (idempotent); False (and nothing) with CUDA."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    token_dispatcher.torch = _TorchWithHostStreams()
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy
    _even_collectives_for_uneven_splits()
    _applied = True
    return True


class _HostEvent:
    """An event on the host: everything before it has happened."""

    def synchronize(self) -> None:
        pass


class _HostStream:
    """A stand-in for ``torch.cuda.Stream``: work on the host runs in program order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _HostEvent:
        return _HostEvent()

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


class _CudaWithHostStreams(types.ModuleType):
    """``torch.cuda`` with Stream, Event, stream(), current_stream() for the host."""

    Stream = _HostStream
    Event = _HostEvent

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_stream(*args: Any, **kwargs: Any) -> _HostStream:
        return _HOST_STREAM

    @staticmethod
    def stream(stream: Any) -> contextlib.nullcontext:
        return contextlib.nullcontext()


class _TorchWithHostStreams(types.ModuleType):
    """``torch`` for ``token_dispatcher.py``: its own, but ``cuda`` has host streams."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaWithHostStreams()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """``moe_utils.maybe_move_tensor_to_cpu`` where the tensor is already on the host: a
    numpy array when ``as_numpy`` (the split sizes ``all_to_all_single`` takes), else as is."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _even_collectives_for_uneven_splits() -> None:
    """Uneven first-dimension gathers and reduce-scatters from even gloo collectives."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = (
        mappings._gather_along_first_dim,
        mappings._reduce_scatter_along_first_dim,
    )

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])

    def reduce_scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        return torch.split(total, [int(n) for n in input_split_sizes])[group.rank()].clone()

    mappings._gather_along_first_dim = gather_uneven
    mappings._reduce_scatter_along_first_dim = reduce_scatter_uneven
