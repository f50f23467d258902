"""Multi-token-prediction training of the policy (the recipe's ``policy.mtp``).

DeepSeek-V3/Kimi-K2 and GLM-4.5 checkpoints hold ``num_nextn_predict_layers`` MTP layers after
the decoder. RL generation does not use them; a trained model is served with them (speculative
decoding), so they must survive the run. Two ways:

- ``loss_weight: 0`` (the default): carried frozen beside the model, bit for bit, as files
  (``weights/mtp.py``): convert copies them into the checkpoint's ``mtp/`` folder, the export
  copies them back. Nothing of them is built, trained or synced.
- ``loss_weight > 0``: built in megatron on the policy's last pipeline stage
  (``models/mtp.py``) and trained with loss_weight x (token-mean cross-entropy of each depth's
  prediction of the rollout's own next-next tokens); that loss reaches the MTP layers only,
  never the trunk, the embedding or the LM head (verl's ``detach_encoder``), so the policy
  update is the RL objective's alone. They travel in the model's checkpoint and export; the
  rollout engine gets none of them (vLLM loads none).

Either way the critic never has MTP layers (a value head). Routing replay covers the decoder's
routers only: the MTP layers route from their own scores in every pass.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class MTPSettings:
    """What the policy does with its multi-token-prediction layers."""

    loss_weight: float = 0.0
    """> 0: build the MTP layers in megatron and train them with this weight on their loss; 0: carry them frozen as files (weights/mtp.py)."""

    def __post_init__(self) -> None:
        if not self.loss_weight >= 0:  # NaN too
            raise ValueError(
                f"policy.mtp.loss_weight={self.loss_weight} must be >= 0 (0: the MTP layers "
                "stay frozen, carried as files; > 0: trained with that weight)"
            )

    @property
    def trained(self) -> bool:
        """Whether the MTP layers are built in megatron and trained."""
        return self.loss_weight > 0


def check_mtp_fits(
    settings: MTPSettings, *, mtp_num_layers: int, vpp: int | None, cp: int, model: str
) -> None:
    """ValueError where ``policy.mtp.loss_weight`` > 0 cannot run: a model without MTP layers
    (``num_nextn_predict_layers`` 0), a virtual pipeline (megatron-core 0.16.1 places MTP
    layers through ``parallel_state`` only), context parallelism (the MTP loss's targets are
    not shifted across CP chunks)."""
    if not settings.trained:
        return
    weight = f"policy.mtp.loss_weight={settings.loss_weight}"
    if not mtp_num_layers:
        raise ValueError(
            f"{weight} but the policy ({model}) has no multi-token-prediction layers "
            "(num_nextn_predict_layers=0); set policy.mtp.loss_weight=0"
        )
    if vpp is not None:
        raise ValueError(
            f"{weight} with policy.layout.vpp={vpp}: megatron-core 0.16.1 builds MTP layers on "
            "the last virtual stage through parallel_state only; set policy.layout.vpp=null or "
            "policy.mtp.loss_weight=0"
        )
    if cp > 1:
        raise ValueError(
            f"{weight} with policy.layout.cp={cp}: the MTP loss's targets are not shifted "
            "across context-parallel chunks; set policy.layout.cp=1 or policy.mtp.loss_weight=0"
        )
