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


def layout_sizes(*, tp: int, pp: int, cp: int, world_size: int) -> dict[str, int]:
    """{"tp", "cp", "dp", "pp"} sizes of a layout on ``world_size`` ranks (DP takes the rest);
    ValueError naming the sizes when they do not fit."""
    if min(tp, pp, cp) < 1:
        raise ValueError(f"tp, pp, cp must be >= 1, got tp={tp}, pp={pp}, cp={cp}")
    if world_size % (tp * pp * cp):
        raise ValueError(
            f"tp * pp * cp = {tp} * {pp} * {cp} = {tp * pp * cp} does not divide the "
            f"{world_size} ranks; pick sizes whose product divides {world_size} (data "
            f"parallelism takes the rest)"
        )
    return {"tp": tp, "cp": cp, "dp": world_size // (tp * pp * cp), "pp": pp}


def check_layout_pair(policy: ModelLayout, critic: ModelLayout, world_size: int) -> None:
    """ValueError unless both layouts fit ``world_size`` ranks (each model spans all of them).

    Each model runs on its own process groups (``parallel.model_groups``), so in
    megatron-core 0.16.1 every pair of layouts whose tp * pp * cp divides the world is
    supported: any TP, PP (with or without vpp), CP, sequence parallelism and DP for the
    policy, independently of the critic's. None is refused for the pairing itself: the
    process-global state both models share (the RNG tracker, the scratch buffer) is listed,
    with why it is harmless, in ``parallel/model_groups.py``. Tested in one 4-rank job
    (``tests/distributed/step/test_mixed_layouts.py``): policy TP2 + SP / critic TP1 x DP4
    (distributed optimizer); policy DP4 / critic PP2 x DP2; policy TP2 x PP2 (vpp 2) / critic
    CP2 x DP2.
    """
    for name, layout in (("policy", policy), ("critic", critic)):
        try:
            layout_sizes(tp=layout.tp, pp=layout.pp, cp=layout.cp, world_size=world_size)
        except ValueError as err:
            raise ValueError(f"{name} layout: {err}") from None
