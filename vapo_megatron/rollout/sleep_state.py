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

from typing import Literal, Protocol

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


class TrainingStateOffload(Protocol):
    """What the engine asks of the trainer's training-state offload
    (``engine/offload.py::TrainingOffload``), in the order the engine calls it: before its
    weights wake, after the weight sync, when it sleeps again, and at shutdown."""

    @property
    def offloaded(self) -> bool:
        """Whether any training state is off the device now."""

    def offload_for_weights(self) -> None:
        """Everything but the policy's parameters off the device (the sync reads those)."""

    def offload_policy_params(self) -> None:
        """The policy's parameters off the device, before the KV cache is allocated."""

    def restore(self) -> None:
        """Every offloaded byte back on the device."""

    def release(self) -> None:
        """Free what holds the offloaded state between steps (the end of the run)."""
