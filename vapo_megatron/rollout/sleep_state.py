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
from collections.abc import Iterator
from typing import Literal

import torch

from vapo_megatron.parallel.devices import HOST

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

    What moves, per model: its parameters and module buffers, its gradients (megatron's DDP
    grad buffers, ``main_grad``, ``.grad``) and its optimizer's tensors (fp32 main parameters
    and Adam moments of every torch optimizer inside a megatron optimizer). Each distinct
    storage is copied whole into a host buffer (pinned on a GPU, kept for the next step) and
    resized to zero bytes, so every view of it (``main_grad`` into the grad buffer, parameters
    into the param buffer, optimizer shards) stays a valid tensor object and sees its exact
    bytes again after :meth:`restore`. megatron-core's own ``offload_grad_buffers`` zeroes the
    gradients and its optimizer ``offload_to_cpu`` does nothing to CPU tensors; this keeps both
    bit-identical and runs the same on CPU (host to a second host buffer: the CPU twin).

    The order, driven by ``RolloutEngine`` (tests/unit/test_offload_training.py)::

        offload_for_weights   everything except the policy's parameters (the sync reads them)
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
        self._moved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        """(storage now of size 0, host copy of its bytes), in offload order."""
        self._host: list[torch.Tensor] = []
        """Host buffers kept across steps, reused in the same order when sizes match."""
        self.offloaded_bytes = 0
        """Bytes on the host now (0 when everything is on the device)."""

    @property
    def offloaded(self) -> bool:
        return bool(self._moved)

    def offload_for_weights(self) -> None:
        """Critic (all of it), then the policy's gradients and optimizer state; never a storage
        the policy's parameters live in (without the distributed optimizer, fp32 main
        parameters are the model's own)."""
        keep = {_storage_key(t) for t in _param_tensors(self.policy)}
        if self.critic is not None:
            self._offload(_model_tensors(self.critic), keep)
        self._offload(_grad_tensors(self.policy), keep)
        self._offload(_optimizer_tensors(self.policy.optimizer), keep)
        self._empty_cache()

    def offload_policy_params(self) -> None:
        """The policy's parameters and buffers, after the weight sync has read them."""
        self._offload(_model_tensors(self.policy), set())
        self._empty_cache()

    def offload_all(self) -> None:
        """Everything of both models (before the engine is built: vLLM sizes its memory from
        what is free when it starts)."""
        self.offload_for_weights()
        self.offload_policy_params()
        logger.info(
            "training state off the device while vLLM starts: %d storages, %.3f GiB (host "
            "buffers%s)", len(self._moved), self.offloaded_bytes / 2**30,
            ", pinned" if self.pin_memory else "",
        )  # fmt: skip

    def restore(self) -> None:
        """Every offloaded storage back on the device with its exact bytes."""
        for storage, host in reversed(self._moved):
            storage.resize_(host.numel())
            _raw(storage).copy_(host)
        self._moved.clear()
        self.offloaded_bytes = 0

    def _offload(self, tensors, keep: set) -> None:
        device = next(_param_tensors(self.policy)).device  # the training device
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if tensor.device != device or storage.nbytes() == 0 or _storage_key(tensor) in keep:
                continue  # host already (Adam's step count), moved already (a view), or kept
            index = len(self._moved)
            if index < len(self._host) and self._host[index].numel() == storage.nbytes():
                host = self._host[index]
            else:
                host = torch.empty(
                    storage.nbytes(), dtype=torch.uint8, device=HOST, pin_memory=self.pin_memory
                )
                self._host[index:] = [host]
            host.copy_(_raw(storage))
            storage.resize_(0)
            self._moved.append((storage, host))
            self.offloaded_bytes += host.numel()

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


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return str(tensor.device), tensor.untyped_storage().data_ptr()


def _param_tensors(model) -> Iterator[torch.Tensor]:
    for chunk in model.chunks:
        yield from chunk.parameters()
        yield from torch.nn.Module.buffers(chunk)  # megatron's DDP shadows .buffers


def _grad_tensors(model) -> Iterator[torch.Tensor]:
    for chunk in model.chunks:
        # megatron DDP: the grad buffers the main_grad views live in (and the param buffer).
        for buffer in [
            *_ddp_buffers(chunk, "buffers"),
            *_ddp_buffers(chunk, "expert_parallel_buffers"),
        ]:
            if buffer.grad_data is not None:
                yield buffer.grad_data
        for param in chunk.parameters():
            for grad in (getattr(param, "main_grad", None), param.grad):
                if grad is not None:
                    yield grad


def _ddp_buffers(chunk, name: str) -> list:
    buffers = getattr(chunk, name, None)
    return buffers if isinstance(buffers, list) else []


def _optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    """Main parameters and state of every torch optimizer inside a megatron optimizer."""
    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        torch_optimizer = getattr(inner, "optimizer", None)
        if torch_optimizer is None:
            continue
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                yield param
                if param.grad is not None:
                    yield param.grad
        for state in torch_optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _model_tensors(model) -> Iterator[torch.Tensor]:
    yield from _grad_tensors(model)
    yield from _optimizer_tensors(model.optimizer)
    yield from _param_tensors(model)
