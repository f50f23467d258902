"""The order of sleep, wake-up, weight sync and generation, as a small state machine.

On GPU the engine shares the device with training: it sleeps while the trainer runs and wakes
for the rollout in a fixed order::

    sleep(level) -> wake("weights") -> update_weights(...) -> wake("kv_cache") -> generate -> sleep

Sleep levels (vLLM's):

- 1: weights copied to a pinned host buffer, KV cache discarded. Frees all of the engine's
  device memory but keeps a host copy of the weights (about 16 GB per rank at 32B, TP4), which
  the next step's sync overwrites anyway.
- 2 (the trainer's default, ``rollout.sleep_level``): weights *and* KV cache discarded. What
  vLLM allocated while building the model is its "weights" pool, and level 2 throws away all
  of it: parameters, registered buffers, and tensors held as plain module attributes. On wake
  vLLM copies back the registered buffers it saved (rotary ``cos_sin_cache``, ...); the sync
  rewrites every parameter; nothing restores the plain attributes, so ``RolloutEngine`` saves
  those on host before the sleep and copies them back after ``wake("weights")``
  (``engine.unsaved_module_tensors``; the garbage rollouts of vLLM #16564 / NeMo-RL #2631 came
  from state of that kind; vLLM 0.32's Qwen2 keeps none on the device). A regression shows as
  the per-step log-prob gap warning (``rollout.logprob_gap_warn``): vLLM's log-probs stop
  matching the policy's.

``SleepState`` holds only the bookkeeping and raises ``EngineStateError`` on a wrong order
(a sync into a sleeping engine, generating with the weights or the KV cache asleep, waking
the KV cache before the weights, generating after a level-2 sleep without a sync, anything
after a failed sync), so that a mistake is an error instead of silently corrupt weights. On
CPU vLLM has no sleep mode: the engine skips vLLM's calls but keeps this bookkeeping, so the
CPU tests hold the GPU order.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal

import torch

from vapo_megatron.rollout.host_arena import HostArena

logger = logging.getLogger(__name__)

SleepLevel = Literal[1, 2]
TAGS = ("weights", "kv_cache")


class EngineStateError(RuntimeError):
    """An engine operation called in the wrong state (see the module docstring for the order)."""


class SleepState:
    """Where the engine's memory is and whether its weights are usable."""

    def __init__(self) -> None:
        self.weights: Literal["awake", "offloaded", "discarded"] = "awake"
        """awake: on the device; offloaded: on host (level 1); discarded: gone (level 2)."""
        self.kv_cache_awake = True
        self.weights_valid = True
        """False after a level-2 wake until a sync completes, and after a failed sync."""
        self.updating = False
        self.broken = False
        """A sync raised midway: layers may be half loaded; only a new engine helps."""

    @property
    def asleep(self) -> bool:
        return self.weights != "awake" or not self.kv_cache_awake

    def _check_usable(self, what: str) -> None:
        if self.broken:
            raise EngineStateError(
                f"{what}: a weight sync failed midway and left the engine's layers half "
                "loaded; shut this engine down and build a new one"
            )
        if self.updating:
            raise EngineStateError(f"{what}: a weight sync is in progress")

    def sleep(self, level: SleepLevel) -> None:
        self._check_usable("sleep")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.asleep:
            raise EngineStateError(
                f"sleep(level={level}): the engine is already (partly) asleep "
                f"(weights {self.weights}, KV cache {'awake' if self.kv_cache_awake else 'asleep'})"
            )
        self.weights = "offloaded" if level == 1 else "discarded"
        self.kv_cache_awake = False

    def wake(self, tag: str) -> None:
        """Wake one tag. Waking what is already awake is allowed (a fresh engine is awake)."""
        self._check_usable(f"wake_up({tag!r})")
        if tag not in TAGS:
            raise ValueError(f"wake_up tags must be 'weights' and/or 'kv_cache', got {tag!r}")
        if tag == "weights":
            if self.weights == "discarded":
                self.weights_valid = False  # memory is back, its contents are not
            self.weights = "awake"
            return
        if self.weights != "awake":
            raise EngineStateError(
                "wake_up('kv_cache') before wake_up('weights'): wake the weights first, sync, "
                "then wake the KV cache (so the KV cache is not allocated while buckets are in "
                "flight)"
            )
        if not self.weights_valid:
            raise EngineStateError(
                "wake_up('kv_cache'): the weights were discarded by a level-2 sleep and have not "
                "been synced since; call update_weights with the whole model first"
            )
        self.kv_cache_awake = True

    def begin_update(self) -> None:
        self._check_usable("update_weights")
        if self.weights != "awake":
            raise EngineStateError(
                f"update_weights into a sleeping engine (weights {self.weights}): call "
                "wake_up(['weights']) first; loading into offloaded or discarded weights would "
                "be lost or corrupt them"
            )
        self.updating = True

    def end_update(self, ok: bool) -> None:
        """After a sync: ``ok`` False (it raised) marks the engine broken for good."""
        assert self.updating
        self.updating = False
        if ok:
            self.weights_valid = True
        else:
            self.broken = True

    def check_generate(self) -> None:
        self._check_usable("generate")
        if self.weights != "awake" or not self.kv_cache_awake:
            raise EngineStateError(
                f"generate while the engine sleeps (weights {self.weights}, KV cache "
                f"{'awake' if self.kv_cache_awake else 'asleep'}): wake_up(['weights']), sync "
                "if needed, then wake_up(['kv_cache'])"
            )
        if not self.weights_valid:
            raise EngineStateError(
                "generate with weights discarded by a level-2 sleep and not synced since"
            )


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

    The order, driven by ``RolloutEngine`` (tests/unit/test_offload_training.py)::

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
