"""How one model (policy or critic) is split over the ranks: the recipe's ``*.layout`` section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class ModelShape(Protocol):
    """What a layout is checked against: the attributes of ``models.config.HFModelConfig``
    that ``ModelLayout.check`` reads (config/ stays below models/ and free of model code)."""

    family: str
    num_attention_heads: int
    num_key_value_heads: int
    num_layers: int
    num_experts: int
    moe_intermediate_size: int
    mtp_num_layers: int

    @property
    def is_moe(self) -> bool: ...


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
    ep: int = 1
    """Expert-parallel size (MoE models): each rank holds num_experts / ep experts. Expert
    groups are cut from the tp * cp * dp ranks of a pipeline stage, as megatron's are."""
    etp: int | None = None
    """Expert tensor-parallel size; None: the same as tp (megatron's default). Expert data
    parallelism takes the rest: tp * cp * dp / (etp * ep)."""

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size in effect (``etp``, else ``tp``)."""
        return self.tp if self.etp is None else self.etp

    def check(self, hf: ModelShape, *, name: str = "", model: str = "") -> None:
        """ValueError naming the value and the fix for a layout the model cannot take.
        ``name``: the layout's place in the recipe ("policy.layout"), ``model``: the model's
        directory; both named in the messages that say which setting to drop."""
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
        self._check_experts(hf, name, model)

    def _check_experts(self, hf: ModelShape, name: str, model: str) -> None:
        if min(self.ep, self.expert_tp) < 1:
            raise ValueError(f"ep and etp must be >= 1, got ep={self.ep}, etp={self.etp}")
        if not hf.is_moe:
            if self.ep != 1 or self.etp not in (None, self.tp):
                raise ValueError(self._dense_experts_message(hf, name, model))
            return
        if hf.num_experts % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide num_experts={hf.num_experts}; pick an ep that does"
            )
        if hf.moe_intermediate_size % self.expert_tp:
            raise ValueError(
                f"expert tensor parallelism {self.expert_tp} (etp, else tp) must divide "
                f"moe_intermediate_size={hf.moe_intermediate_size}; pick another etp"
            )
        # megatron-core 0.16.1 MoELayer.forward raises in training for TP > 1 without
        # sequence parallelism (the dispatcher would route each TP rank's copy of a token).
        if self.tp > 1 and not self.sequence_parallel:
            raise ValueError(
                f"an MoE model at tp={self.tp} needs sequence_parallel=true (megatron-core's "
                "MoE layer refuses tensor parallelism without it in training)"
            )

    def _dense_experts_message(self, hf: ModelShape, name: str, model: str) -> str:
        """Why a dense model takes no expert parallelism, and which settings to drop."""
        key = f"{name}." if name else ""
        given = [f"{key}ep={self.ep}"] if self.ep != 1 else []
        given += [f"{key}etp={self.etp}"] if self.etp not in (None, self.tp) else []
        which = f"{model} is" if model else "this model is"
        return (
            f"{', '.join(given)}: expert parallelism needs a mixture-of-experts model (the "
            f"qwen3_moe, deepseek_v3 and glm4_moe families), but {which} a dense {hf.family} "
            f"model (no experts). Drop {key}ep and {key}etp from the recipe (ep=1, etp=null), "
            "or train an MoE model"
        )


def layout_sizes(
    *, tp: int, pp: int, cp: int, world_size: int, ep: int = 1, etp: int | None = None
) -> dict[str, int]:
    """{"tp", "cp", "dp", "pp", "ep", "etp", "edp"} sizes of a layout on ``world_size`` ranks
    (DP takes the rest); ValueError naming the sizes when they do not fit.

    Expert groups as megatron-core 0.16.1's ``initialize_model_parallel`` cuts them: the
    tp * cp * dp ranks of each pipeline stage are split again into etp (expert TP, default
    tp) x ep x edp (expert data parallel, the rest), so etp * ep must divide tp * cp * dp."""
    etp = tp if etp is None else etp
    if min(tp, pp, cp, ep, etp) < 1:
        raise ValueError(
            f"tp, pp, cp, ep, etp must be >= 1, got tp={tp}, pp={pp}, cp={cp}, ep={ep}, etp={etp}"
        )
    if world_size % (tp * pp * cp):
        raise ValueError(
            f"tp * pp * cp = {tp} * {pp} * {cp} = {tp * pp * cp} does not divide the "
            f"{world_size} ranks; pick sizes whose product divides {world_size} (data "
            f"parallelism takes the rest)"
        )
    stage = world_size // pp
    if stage % (etp * ep):
        raise ValueError(
            f"etp * ep = {etp} * {ep} = {etp * ep} does not divide the {stage} ranks of a "
            f"pipeline stage (tp * cp * dp = {world_size} / pp {pp}); pick an ep (and etp) "
            f"whose product divides {stage} (expert data parallelism takes the rest)"
        )
    dp = world_size // (tp * pp * cp)
    return {
        "tp": tp,
        "cp": cp,
        "dp": dp,
        "pp": pp,
        "ep": ep,
        "etp": etp,
        "edp": stage // (etp * ep),
    }


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
            layout_sizes(
                tp=layout.tp, pp=layout.pp, cp=layout.cp, world_size=world_size,
                ep=layout.ep, etp=layout.etp,
            )  # fmt: skip
        except ValueError as err:
            raise ValueError(f"{name} layout: {err}") from None
