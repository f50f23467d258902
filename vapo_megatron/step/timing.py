"""Seconds per phase of one step, and the step's time metrics (step 8)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vapo_megatron.engine.model_engine import ModelEngine
    from vapo_megatron.step.rollout import RolloutStats


class Timer:
    """Seconds per phase of one step; ``megatron`` counts the models' own compute (their
    schedules' forward, backward and optimizer seconds) from the timer's start."""

    def __init__(self, engines: Sequence[ModelEngine] = ()) -> None:
        self.seconds: dict[str, float] = {}
        self._engines = list(engines)
        self._compute_before = self._compute()
        self._last = time.perf_counter()

    def _compute(self) -> float:
        return sum(e.compute_seconds for e in self._engines)

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now

    def lap_rollout(self, stats: RolloutStats) -> None:
        """Close the rollout's lap; generation and grading happened inside it, and are
        reported apart, not twice."""
        self.lap("rollout_other")
        self.seconds["rollout_other"] -= stats.generate_seconds + stats.reward_seconds
        self.seconds["rollout"] = stats.generate_seconds
        self.seconds["reward"] = stats.reward_seconds

    def metrics(self, num_tokens: int) -> dict[str, float]:
        """time/<phase>, time/step, time/megatron, time/overhead (everything but vLLM
        generation and Megatron's compute), overhead_fraction and tokens_per_second over
        ``num_tokens`` prompt and response tokens."""
        metrics = {f"time/{phase}": seconds for phase, seconds in self.seconds.items()}
        total = sum(self.seconds.values())
        metrics["time/step"] = total
        megatron = self._compute() - self._compute_before
        metrics["time/megatron"] = megatron
        metrics["time/overhead"] = total - megatron - self.seconds.get("rollout", 0.0)
        metrics["overhead_fraction"] = metrics["time/overhead"] / total if total > 0 else math.nan
        metrics["tokens_per_second"] = num_tokens / total if total > 0 else math.nan
        return metrics
