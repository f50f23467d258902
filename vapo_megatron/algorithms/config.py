"""The algorithm config: every VAPO change, and every baseline, is a value here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from vapo_megatron.algorithms.losses import AGGREGATIONS, Aggregation
from vapo_megatron.algorithms.rollout_correction import RolloutCorrectionConfig

ROUTING_REPLAYS: tuple[str, ...] = ("none", "rollout")


@dataclass(frozen=True, kw_only=True)
class AlgoConfig:
    """What the step computes. Defaults are the VAPO paper's values (arXiv 2504.05118)."""

    advantage_estimator: Literal["gae", "group"] = "gae"
    """'gae': PPO with a critic (VAPO, PPO, VC-PPO, ORZ). 'group': value-free group-mean baseline (GRPO, DAPO)."""
    value_pretrain_steps: int = 50
    """Critic-only steps on Monte-Carlo returns of the frozen initial policy before policy updates (0: none)."""
    gamma: float = 1.0
    """Discount factor."""
    lambda_critic: float = 1.0
    """GAE lambda of the critic's targets (used when decoupled_gae)."""
    lambda_policy: float = 0.95
    """GAE lambda of the policy's advantages when length_adaptive_alpha is None."""
    length_adaptive_alpha: float | None = 0.05
    """Length-adaptive GAE: lambda_policy = 1 - 1/(alpha * l) per sequence. None: fixed lambda_policy."""
    decoupled_gae: bool = True
    """True: critic targets use lambda_critic. False: they use the policy's lambda (one lambda, vanilla PPO)."""
    loss_aggregation: Aggregation = "token-mean"
    """Policy-loss reduction: 'token-mean' (token-level loss), 'seq-mean-token-mean' (sample-level), 'seq-mean-token-sum'."""
    eps_low: float = 0.2
    """Lower clip range: the ratio is clipped at 1 - eps_low."""
    eps_high: float = 0.28
    """Upper clip range: the ratio is clipped at 1 + eps_high (clip-higher when > eps_low)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding negative-advantage losses; None: off."""
    positive_nll_coef: float = 0.1
    """mu of the positive-example LM loss (NLL on correct responses); 0: off."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    value_clip: float | None = None
    """Clip the critic's new values to old +- value_clip in the value loss; None: off."""
    prompts_per_step: int = 512
    """Prompts per training step: 512 with VAPO's group sampling; the paper's PPO baselines take 8192."""
    samples_per_prompt: int = 16
    """Responses sampled per prompt: 16 with group sampling, 1 for PPO. (Mini-batches: the trainer's.)"""
    group_scale_by_std: bool = True
    """Group baseline only: divide by the group std (GRPO/DAPO) or not (mean-only)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more until the step is full."""
    overlong_buffer_len: int | None = None
    """DAPO soft overlong punishment: the last this-many tokens before the max length are penalised; None: off."""
    critic_init: Literal["policy", "reward_model"] = "reward_model"
    """Where the critic's weights start: a reward model (the paper) or the policy checkpoint."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Importance correction of the policy loss for vLLM's sampling policy (TIS, MIS/IcePop); off by default."""
    routing_replay: Literal["none", "rollout"] = "none"
    """MoE models: 'rollout' replays the engine's routed experts in the policy's scoring and update passes (R3)."""
    off_policy_correction: Literal["none", "vtrace"] = "vtrace"
    """Stale samples (rollout.lag > 0): 'vtrace' weights GAE by truncated pi_old/mu traces; 'none': plain GAE (the peers)."""
    rho_bar: float = 1.0
    """V-trace: truncation of the ratio weighting each TD error (rho_t = min(rho_bar, pi_old/mu))."""
    c_bar: float = 1.0
    """V-trace: truncation of the ratio in the traces (c_t = min(c_bar, pi_old/mu)); <= rho_bar."""

    def __post_init__(self) -> None:
        if self.advantage_estimator not in ("gae", "group"):
            raise ValueError(
                f"advantage_estimator must be 'gae' or 'group', got {self.advantage_estimator!r}"
            )
        if self.loss_aggregation not in AGGREGATIONS:
            raise ValueError(
                f"loss_aggregation must be one of {AGGREGATIONS}, got {self.loss_aggregation!r}"
            )
        for name in ("lambda_critic", "lambda_policy"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {getattr(self, name)}")
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"gamma must lie in (0, 1], got {self.gamma}")
        if self.length_adaptive_alpha is not None and self.length_adaptive_alpha <= 0:
            raise ValueError(
                f"length_adaptive_alpha must be > 0 or null, got {self.length_adaptive_alpha}"
            )
        if not (0.0 <= self.eps_low < 1.0 and self.eps_high >= 0.0):
            raise ValueError(
                f"need 0 <= eps_low < 1 and eps_high >= 0, got {self.eps_low}, {self.eps_high}"
            )
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 or null, got {self.dual_clip}")
        if self.value_pretrain_steps < 0:
            raise ValueError(f"value_pretrain_steps must be >= 0, got {self.value_pretrain_steps}")
        if self.prompts_per_step < 1 or self.samples_per_prompt < 1:
            raise ValueError(
                f"prompts_per_step and samples_per_prompt must be >= 1, got {self.prompts_per_step}, {self.samples_per_prompt}"
            )
        if self.routing_replay not in ROUTING_REPLAYS:
            raise ValueError(
                f"routing_replay must be one of {ROUTING_REPLAYS}, got {self.routing_replay!r}"
            )
        if self.off_policy_correction not in ("none", "vtrace"):
            raise ValueError(
                "off_policy_correction must be 'none' or 'vtrace', "
                f"got {self.off_policy_correction!r}"
            )
        if not (0.0 < self.c_bar <= self.rho_bar):
            raise ValueError(
                f"V-trace needs 0 < c_bar <= rho_bar, got c_bar={self.c_bar}, rho_bar={self.rho_bar}"
            )
        if self.critic_init not in ("policy", "reward_model"):
            raise ValueError(
                f"critic_init must be 'policy' or 'reward_model', got {self.critic_init!r}"
            )
        if self.dynamic_sampling and self.samples_per_prompt < 2:
            raise ValueError(
                "dynamic_sampling drops groups whose rewards are all equal, which is every group "
                f"at samples_per_prompt={self.samples_per_prompt}; set samples_per_prompt >= 2 "
                "or dynamic_sampling=false"
            )
        if self.advantage_estimator == "group":
            if self.samples_per_prompt < 2:
                raise ValueError(
                    "the group baseline needs samples_per_prompt >= 2; set it or use advantage_estimator=gae"
                )
            if self.value_pretrain_steps:
                raise ValueError(
                    "value_pretrain_steps needs a critic; set it to 0 with advantage_estimator=group"
                )

    @property
    def uses_critic(self) -> bool:
        return self.advantage_estimator == "gae"
