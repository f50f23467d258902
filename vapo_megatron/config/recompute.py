"""Activation recompute of one model: the recipe's ``*.recompute`` section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class RecomputeSettings:
    """Activation recompute of one model (megatron-core's recompute_* TransformerConfig fields)."""

    granularity: Literal["selective", "full"] | None = None
    """None: keep every activation; selective: recompute core attention; full: keep only each recomputed layer's input."""
    method: Literal["uniform", "block"] | None = None
    """full only: uniform recomputes groups of num_layers layers; block the first num_layers layers of each pipeline stage."""
    num_layers: int | None = None
    """full only: layers per recomputed group (uniform) or recomputed layers per stage (block)."""

    def __post_init__(self) -> None:
        if self.granularity not in (None, "selective", "full"):
            raise ValueError(
                f"recompute.granularity must be selective, full or null, got {self.granularity!r}"
            )
        if self.granularity == "full":
            if self.method not in ("uniform", "block") or not self.num_layers:
                raise ValueError(
                    f"recompute.granularity=full needs method uniform or block and num_layers >= "
                    f"1, got method={self.method!r} num_layers={self.num_layers!r}; e.g. "
                    f"recompute.method=uniform recompute.num_layers=1"
                )
            if self.num_layers < 1:
                raise ValueError(f"recompute.num_layers must be >= 1, got {self.num_layers}")
        elif self.method is not None or self.num_layers is not None:
            raise ValueError(
                f"recompute.method={self.method!r} / num_layers={self.num_layers!r} only apply to "
                f"granularity=full (got {self.granularity!r}): remove them or set "
                f"recompute.granularity=full"
            )

    def transformer_config_kwargs(self) -> dict[str, object]:
        """The TransformerConfig fields these settings set."""
        return {
            "recompute_granularity": self.granularity,
            "recompute_method": self.method,
            "recompute_num_layers": self.num_layers,
        }
