"""How one model (policy or critic) is split over the ranks: the recipe's ``*.layout`` section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only its attributes are read; the config stays free of model code
    from vapo_megatron.models.config import HFModelConfig


@dataclass(frozen=True, kw_only=True)
class ModelLayout:
    """How one model (policy or critic) is split; data parallelism takes the remaining ranks."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    cp: int = 1
    """Context-parallel size."""
    vpp: int | None = None
    """Virtual pipeline stages per pipeline rank (interleaved schedule); None: off."""
    sequence_parallel: bool = False
    """Shard norms' and dropouts' activations along the sequence across TP (needs tp > 1)."""

    def check(self, hf: HFModelConfig) -> None:
        """ValueError naming the value and the fix for a layout the model cannot take."""
        if min(self.tp, self.pp, self.cp) < 1 or (self.vpp is not None and self.vpp < 1):
            raise ValueError(f"parallel sizes must be >= 1, got {self}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1; set sequence_parallel=false")
        if self.vpp is not None and self.pp == 1:
            raise ValueError("virtual pipeline stages (vpp) need pp > 1; set vpp=null")
        kv = hf.num_key_value_heads
        if hf.num_attention_heads % self.tp or (kv % self.tp and self.tp % kv):
            raise ValueError(
                f"tp={self.tp} must divide num_attention_heads={hf.num_attention_heads}, and "
                f"num_key_value_heads={kv} must be a multiple or a divisor of it; pick another tp"
            )
        stages = self.pp * (self.vpp or 1)
        if hf.num_layers % stages:
            raise ValueError(
                f"pp * vpp = {stages} must divide num_layers={hf.num_layers}; change pp or vpp"
            )
