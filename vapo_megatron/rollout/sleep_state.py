"""The order of sleep, wake-up, weight sync and generation, as a small state machine.

On GPU the engine shares the device with training: it sleeps while the trainer runs and wakes
for the rollout in a fixed order::

    sleep(level) -> wake("weights") -> update_weights(...) -> wake("kv_cache") -> generate -> sleep

Sleep levels (vLLM's):

- 1: weights copied to host memory, KV cache discarded. Frees all of the engine's device
  memory; waking the weights copies them back, so they are still valid without a sync.
- 2: weights *and* KV cache discarded (only small buffers such as RoPE caches kept on host).
  Frees the same device memory and no host memory is spent; the weights must be synced in
  full after ``wake("weights")``. The natural level for RL, where every rollout is preceded
  by a sync anyway.

``SleepState`` holds only the bookkeeping and raises ``EngineStateError`` on a wrong order
(a sync into a sleeping engine, generating with the weights or the KV cache asleep, waking
the KV cache before the weights, generating after a level-2 sleep without a sync, anything
after a failed sync), so that a mistake is an error instead of silently corrupt weights. On
CPU vLLM has no sleep mode: the engine skips vLLM's calls but keeps this bookkeeping, so the
CPU tests hold the GPU order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

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
    """Moves training memory (gradient buffers, optimizer state) to host while the engine is awake.

    GPU only: on CPU everything already lives in host memory and both calls do nothing.
    ``chunks`` are megatron-core ``DistributedDataParallel`` modules, ``optimizers`` megatron
    optimizers (both provide the offload/restore methods used here); the project's rollout
    code only calls them.
    """

    def __init__(self, chunks: Sequence, optimizers: Sequence, *, on_device: bool) -> None:
        self.chunks, self.optimizers, self.on_device = list(chunks), list(optimizers), on_device
        self.offloaded = False

    def offload(self) -> None:
        if not self.on_device or self.offloaded:
            return
        for chunk in self.chunks:
            chunk.offload_grad_buffers()
        for optimizer in self.optimizers:
            optimizer.offload_to_cpu()
        self.offloaded = True

    def restore(self) -> None:
        if not self.on_device or not self.offloaded:
            return
        for optimizer in self.optimizers:
            optimizer.restore_from_cpu()
        for chunk in self.chunks:
            chunk.restore_grad_buffers()
        self.offloaded = False
