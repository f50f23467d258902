"""Mixture-of-experts training settings of one model (the recipe's ``policy.moe``, ``critic.moe``).

Read only for an MoE model (``HFModelConfig.is_moe``); a dense model ignores them. The router's
arithmetic (softmax, top-k, renormalisation) is the checkpoint's and lives in
``models/config.py``; these are the training-time choices around it.

Defaults, and what RL peers use (read 2026-12):

- Load-balancing (aux) loss: **off** (coefficient 0). verl's Megatron bridge for Qwen3-MoE
  (``mbridge/models/qwen3moe.py``) sets ``moe_router_load_balancing_type="none"`` with the
  comment "default None for RL"; Megatron-LM's own Qwen3-30B-A3B example
  (``examples/post_training/modelopt/conf/qwen/Qwen3-30B-A3B.sh``, and ms-swift's SFT and DPO
  MoE examples) uses ``aux_loss`` at 1e-3, which is the pretraining/SFT choice. For RL on a
  pretrained MoE the router is already balanced, the rollout engine routes with the same
  weights, and an extra loss moves the router for a reason unrelated to the reward, which
  widens the very rollout/training routing mismatch that routing replay and importance
  correction are there to remove. Set it (e.g. 1e-3) for long runs where experts collapse.
- z-loss: **off** (0), as in all of the above.
- Router dtype: **fp32** (the logits, softmax and top-k in fp32 under bf16 training), as
  Megatron-LM's Qwen3 example and transformers (softmax in fp32) do; fp64 is megatron's other
  choice.
- Token dispatcher: **alltoall**, the dispatcher of every recipe above (EP > 1 exchanges just
  the routed tokens); 'allgather' is kept for debugging.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True, kw_only=True)
class MoESettings:
    """Router losses, router precision and token dispatch of an MoE model's training."""

    aux_loss_coeff: float = 0.0
    """Load-balancing (switch) loss coefficient per MoE layer; 0: off (RL peers' choice)."""
    z_loss_coeff: float = 0.0
    """Router z-loss coefficient (penalises large router logits); 0: off."""
    router_dtype: Literal["fp32", "fp64"] = "fp32"
    """Precision of the router's logits, softmax and top-k."""
    token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """How tokens reach the experts of other EP ranks (megatron's moe_token_dispatcher_type)."""
    router_bias_update_rate: float = 0.0
    """Step of the expert-score bias (DeepSeek-V3/GLM-4.5's ``e_score_correction_bias``,
    megatron's ``expert_bias``) after each optimizer step: +-rate toward balanced expert loads
    (aux-loss-free balancing). 0: frozen, exported unchanged (slime's and the RL peers'
    choice: a bias that moves changes which experts the rollout engine picks). Ignored by
    routers without a bias (Qwen3-MoE)."""

    def __post_init__(self) -> None:
        for name in ("aux_loss_coeff", "z_loss_coeff"):
            if getattr(self, name) < 0:
                raise ValueError(f"moe.{name}={getattr(self, name)} must be >= 0")
        if self.router_bias_update_rate < 0:
            raise ValueError(
                f"moe.router_bias_update_rate={self.router_bias_update_rate} must be >= 0 "
                "(0: the expert bias stays frozen)"
            )
        if self.router_dtype not in ("fp32", "fp64"):
            raise ValueError(f"moe.router_dtype={self.router_dtype!r} must be fp32 or fp64")
        if self.token_dispatcher not in ("alltoall", "allgather"):
            raise ValueError(
                f"moe.token_dispatcher={self.token_dispatcher!r} must be alltoall or allgather"
            )

    def transformer_config_kwargs(self) -> dict[str, Any]:
        """megatron-core 0.16.1 ``TransformerConfig`` fields of these settings (MoE models)."""
        return {
            "moe_router_load_balancing_type": "aux_loss" if self.aux_loss_coeff > 0 else "none",
            "moe_aux_loss_coeff": self.aux_loss_coeff,
            "moe_z_loss_coeff": self.z_loss_coeff or None,
            "moe_router_dtype": self.router_dtype,
            "moe_token_dispatcher_type": self.token_dispatcher,
            "moe_router_bias_update_rate": self.router_bias_update_rate,
        }
