"""Adam and its learning-rate schedule for one model: the recipe's ``*.optim`` section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class OptimSettings:
    """Adam settings of one model."""

    lr: float = 1e-6
    """Learning rate (VAPO: 1e-6 policy, 2e-6 critic)."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.95
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0: no clipping)."""
    distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""
    lr_warmup_steps: int = 0
    """Steps of linear warmup from 0 to lr (step k of the warmup uses lr * k / warmup)."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate shape after the warmup, from lr down to min_lr."""
    lr_decay_steps: int | None = None
    """Step at which the decay reaches min_lr (counted from 0, warmup included); linear/cosine."""
    min_lr: float = 0.0
    """Learning rate at and after lr_decay_steps."""

    def __post_init__(self) -> None:
        if self.lr_decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(
                f"lr_decay_style must be constant, linear or cosine, got {self.lr_decay_style!r}"
            )
        if self.lr_warmup_steps < 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(
                f"need lr_warmup_steps >= 0 and 0 <= min_lr <= lr, got lr_warmup_steps="
                f"{self.lr_warmup_steps}, min_lr={self.min_lr}, lr={self.lr}"
            )
        if self.lr_decay_style != "constant" and (
            self.lr_decay_steps is None or self.lr_decay_steps <= self.lr_warmup_steps
        ):
            raise ValueError(
                f"lr_decay_style={self.lr_decay_style!r} needs lr_decay_steps > lr_warmup_steps "
                f"({self.lr_warmup_steps}), got {self.lr_decay_steps}; set lr_decay_steps to the "
                f"total number of steps"
            )
