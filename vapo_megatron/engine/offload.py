"""The training state of both models off the device while the rollout engine is awake (on a GPU
the engine and training share the device), and back when it sleeps.

The engine drives the order (``rollout/sleep_state.py::TrainingStateOffload`` is what it
asks); the state it moves (megatron DDP buffers, optimizer state) is the trainer's, so the
code that reaches into it lives here. Host copies go to one exactly sized, page-locked arena
(``host_arena.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence

import torch

from vapo_megatron.engine.host_arena import HostArena
from vapo_megatron.rollout.sleep_state import EngineStateError

logger = logging.getLogger(__name__)


class TrainingOffload:
    """Moves the training state of both models off the device while the engine is awake.

    What leaves, per model: its parameters and module buffers and its optimizer's tensors
    (fp32 main parameters and Adam moments of every torch optimizer inside a megatron
    optimizer) are copied to host; its gradients (megatron's DDP grad buffers, ``main_grad``,
    ``.grad`` and ``decoupled_grad``) are dropped, and come back as zeros: every update starts
    by zeroing them (``ModelEngine.run``: ``zero_grad_buffer`` and ``optimizer.zero_grad``),
    so copying them (about 30 GiB per GPU at 32B, each way, every step) would only move bytes
    that are overwritten. megatron-core's own ``offload_grad_buffers``/``restore_grad_buffers``
    do the same to the DDP grad buffers; this also covers the gradients outside them, and never
    drops a storage that parameters or optimizer state live in (e.g. a grad buffer shared with
    the param buffer for MXFP8 all-gathers, or fp32 main parameters that are the model's own).

    Each distinct storage is resized to zero bytes, so every view of it (``main_grad`` into
    the grad buffer, parameters into the param buffer, optimizer shards) stays a valid tensor
    object and sees its bytes again (or zeros, for gradients) after :meth:`restore`. The host
    copies are views of one ``host_arena.HostArena`` of exactly the bytes copied (page-locked
    on a GPU, not rounded up; see that module), sized at the first offload of each cycle for
    the whole cycle, kept across steps and released by :meth:`release` (the engine's
    ``shutdown``). It grows only when the state does (Adam's moments appear at the first
    update). On CPU the same code runs with an unpinned arena: the CPU twin.

    The order, driven by ``RolloutEngine`` (tests/unit/engine/test_offload.py)::

        offload_for_weights   gradients dropped; everything else except the policy's
                              parameters copied (the sync reads them)
        (vLLM weights wake, the policy's weights stream into the engine)
        offload_policy_params the policy's parameters, before the KV cache is allocated
        (generate; vLLM sleeps)
        restore               every storage back, in reverse order

    ``policy`` and ``critic`` are objects with ``chunks`` (megatron DDP modules) and
    ``optimizer`` (a megatron optimizer), e.g. ``ModelEngine``; the tensors are collected at
    each offload, since Adam creates its state at the first step.
    """

    def __init__(self, policy, critic=None, *, pin_memory: bool | None = None) -> None:
        self.policy, self.critic = policy, critic
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.arena = HostArena(pin=self.pin_memory)
        self._moved: list[tuple[torch.UntypedStorage, int, torch.Tensor | None]] = []
        """(storage now of size 0, its size, its bytes in the arena or None: a gradient that
        comes back as zeros), in offload order."""
        self._arena_used = 0
        self.offloaded_bytes = 0
        """Bytes copied to the host now (0 when everything is on the device)."""
        self.dropped_bytes = 0
        """Gradient bytes freed now, to come back as zeros."""

    @property
    def offloaded(self) -> bool:
        return bool(self._moved)

    def offload_for_weights(self) -> None:
        """Gradients of both models dropped; the critic's parameters and both optimizers'
        state copied; never a storage the policy's parameters live in (without the distributed
        optimizer, fp32 main parameters are the model's own)."""
        device = self._device()
        params = _storages(_param_tensors(self.policy), device)
        state = _storages(self._state_before_sync(), device, skip=params)
        grads = _storages(self._grad_tensors(), device, skip=params + state)
        if not self._moved:  # the cycle's first offload: room for this phase and the next
            self._reserve(state + params)
        for storage in grads:
            self.dropped_bytes += storage.nbytes()
            self._moved.append((storage, storage.nbytes(), None))
            storage.resize_(0)
        self._copy(state)
        self._empty_cache()

    def offload_policy_params(self) -> None:
        """The policy's parameters and buffers, after the weight sync has read them."""
        params = _storages(_param_tensors(self.policy), self._device())
        if not self._moved:
            self._reserve(params)
        self._copy(params)
        self._empty_cache()

    def offload_all(self) -> None:
        """Everything of both models (before the engine is built: vLLM sizes its memory from
        what is free when it starts)."""
        self.offload_for_weights()
        self.offload_policy_params()
        logger.info(
            "training state off the device while vLLM starts: %d storages, %.3f GiB on the "
            "host (one %sarena of %.3f GiB), %.3f GiB of gradients dropped",
            len(self._moved), self.offloaded_bytes / 2**30,
            "pinned " if self.pin_memory else "", self.arena.nbytes / 2**30,
            self.dropped_bytes / 2**30,
        )  # fmt: skip

    def restore(self) -> None:
        """Every offloaded storage back on the device: its exact bytes, gradients as zeros."""
        for storage, nbytes, host in reversed(self._moved):
            storage.resize_(nbytes)
            if host is None:
                _raw(storage).zero_()
            else:
                _raw(storage).copy_(host)
        self._moved.clear()
        self._arena_used = self.offloaded_bytes = self.dropped_bytes = 0

    def release(self) -> None:
        """Free the host arena (the end of the run); the state must be on the device."""
        if self.offloaded:
            raise EngineStateError(
                "release() while the training state is on the host would lose it: restore() "
                "first (the engine's sleep does)"
            )
        self.arena.release()

    def _state_before_sync(self) -> Iterator[torch.Tensor]:
        if self.critic is not None:
            yield from _optimizer_tensors(self.critic.optimizer)
            yield from _param_tensors(self.critic)
        yield from _optimizer_tensors(self.policy.optimizer)

    def _grad_tensors(self) -> Iterator[torch.Tensor]:
        for model in (self.critic, self.policy):
            if model is not None:
                yield from _grad_tensors(model)

    def _device(self) -> torch.device:
        return next(_param_tensors(self.policy)).device  # the training device

    def _reserve(self, storages: list[torch.UntypedStorage]) -> None:
        """Make the arena hold ``storages`` (the whole cycle's copies), from its start."""
        self.arena.reserve(sum(s.nbytes() for s in storages))
        self._arena_used = 0

    def _copy(self, storages: list[torch.UntypedStorage]) -> None:
        for storage in storages:
            start, nbytes = self._arena_used, storage.nbytes()
            assert start + nbytes <= self.arena.nbytes, "offload found more than it reserved"
            host = self.arena.buffer[start : start + nbytes]
            host.copy_(_raw(storage))
            storage.resize_(0)
            self._moved.append((storage, nbytes, host))
            self._arena_used += nbytes
            self.offloaded_bytes += nbytes

    @staticmethod
    def _empty_cache() -> None:
        # Freed blocks stay in torch's caching allocator until this; vLLM allocates through
        # the driver and would not see them.
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def _raw(storage: torch.UntypedStorage) -> torch.Tensor:
    """The storage's bytes as a flat uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _storages(
    tensors: Iterable[torch.Tensor], device: torch.device, skip: Sequence = ()
) -> list[torch.UntypedStorage]:
    """The distinct storages ``tensors`` live in on ``device`` that hold bytes and are not
    among ``skip``, in first-seen order. A tensor elsewhere (Adam's step count on the host)
    or on an emptied storage (moved already, through another view) is left out."""
    seen = {s.data_ptr() for s in skip}
    out = []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if tensor.device != device or storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        out.append(storage)
    return out


def _param_tensors(model) -> Iterator[torch.Tensor]:
    for chunk in model.chunks:
        yield from chunk.parameters()
        yield from torch.nn.Module.buffers(chunk)  # megatron's DDP shadows .buffers


def _grad_tensors(model) -> Iterator[torch.Tensor]:
    """Every gradient of a model: megatron DDP's grad buffers (``main_grad`` views them), the
    parameters' own, and the optimizer's main parameters' (``.grad``, or ``decoupled_grad``
    with megatron's precision-aware optimizer)."""
    for chunk in model.chunks:
        for buffer in [
            *_ddp_buffers(chunk, "buffers"),
            *_ddp_buffers(chunk, "expert_parallel_buffers"),
        ]:
            if buffer.grad_data is not None:
                yield buffer.grad_data
        for param in chunk.parameters():
            yield from _grads_of(param, "main_grad", "grad")
    for param in _optimizer_params(model.optimizer):
        yield from _grads_of(param, "grad", "decoupled_grad")


def _grads_of(param: torch.Tensor, *names: str) -> Iterator[torch.Tensor]:
    for name in names:
        grad = getattr(param, name, None)
        if grad is not None:
            yield grad


def _ddp_buffers(chunk, name: str) -> list:
    buffers = getattr(chunk, name, None)
    return buffers if isinstance(buffers, list) else []


def _torch_optimizers(optimizer) -> Iterator[torch.optim.Optimizer]:
    """Every torch optimizer inside a megatron optimizer (chained or not)."""
    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        torch_optimizer = getattr(inner, "optimizer", None)
        if torch_optimizer is not None:
            yield torch_optimizer


def _optimizer_params(optimizer) -> Iterator[torch.Tensor]:
    for torch_optimizer in _torch_optimizers(optimizer):
        for group in torch_optimizer.param_groups:
            yield from group["params"]


def _optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    """Main parameters and state of every torch optimizer inside a megatron optimizer."""
    yield from _optimizer_params(optimizer)
    for torch_optimizer in _torch_optimizers(optimizer):
        for state in torch_optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
