"""When to stop critic pretraining: at a step budget, or once explained variance has settled.

VAPO trains the critic alone on Monte-Carlo returns of the frozen initial policy before any
policy update (the paper: 50 steps). :class:`ValuePretrainStop` decides after each critic step
whether to stop: always at ``max_steps``; earlier (not before ``min_steps``) once the latest
explained variance is at least ``ev_threshold`` and the best one seen has not risen by more
than ``min_delta`` for ``patience`` updates.

A NaN explained variance (constant returns, see ``losses.explained_variance``; likewise any
non-finite one) says nothing about the critic: it never passes the threshold and never counts
towards the plateau, so batches of degenerate returns cannot end pretraining early.
"""

from __future__ import annotations

import math

import torch


class ValuePretrainStop:
    """Stop rule for critic pretraining; checkpointable with state_dict / load_state_dict."""

    def __init__(
        self,
        *,
        max_steps: int,
        min_steps: int,
        ev_threshold: float,
        patience: int,
        min_delta: float,
    ) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if not 0 <= min_steps <= max_steps:
            raise ValueError(f"min_steps must lie in [0, max_steps={max_steps}], got {min_steps}")
        if not ev_threshold <= 1.0:
            raise ValueError(
                f"explained variance is at most 1, so ev_threshold={ev_threshold} never passes; "
                "choose a value <= 1"
            )
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        if min_delta < 0:
            raise ValueError(f"min_delta must be >= 0, got {min_delta}")
        self.max_steps = max_steps
        self.min_steps = min_steps
        self.ev_threshold = ev_threshold
        self.patience = patience
        self.min_delta = min_delta
        self.last_step = 0
        """The step of the latest update (critic steps done, counted from 1)."""
        self.best = -math.inf
        """The best finite explained variance seen."""
        self.stale = 0
        """Finite updates since ``best`` last rose by more than min_delta."""

    def update(self, step: int, explained_variance: float | torch.Tensor) -> bool:
        """Record the explained variance after critic step ``step`` (1, 2, ...); True: stop now.

        explained_variance: a float or a 0-dim tensor (``losses.explained_variance``).
        """
        if step <= self.last_step:
            raise ValueError(
                f"steps must increase: got step {step} after step {self.last_step} "
                "(restore the state_dict saved with the checkpoint you resume from)"
            )
        self.last_step = step
        ev = float(explained_variance)
        if math.isfinite(ev):
            if ev > self.best + self.min_delta:
                self.best, self.stale = ev, 0
            else:
                self.stale += 1
        if step >= self.max_steps:
            return True
        settled = math.isfinite(ev) and ev >= self.ev_threshold and self.stale >= self.patience
        return step >= self.min_steps and settled

    def state_dict(self) -> dict[str, float | int]:
        return {"last_step": self.last_step, "best": self.best, "stale": self.stale}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        if set(state) != {"last_step", "best", "stale"}:
            raise ValueError(
                f"a ValuePretrainStop state has keys last_step, best, stale; got {sorted(state)}"
            )
        self.last_step = int(state["last_step"])
        self.best = float(state["best"])
        self.stale = int(state["stale"])
