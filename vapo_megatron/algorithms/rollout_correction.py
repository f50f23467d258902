"""Rollout importance correction: the engine sampled from pi_rollout, the trainer scores pi_old.

vLLM's log-probs (``log pi_rollout``, the trajectories' rollout log-probs) and the trainer's
scoring-pass log-probs (``log pi_old``) differ (kernels, precision; for MoE models, routing),
so the samples are off-policy for the PPO ratio pi_theta / pi_old. The correction weighs each
token's policy loss by a detached coefficient w computed from rho_t = pi_old(y_t) /
pi_rollout(y_t) (Liu, Li et al. 2025, "When Speed Kills Stability"; verl's
``trainer/ppo/rollout_corr_helper.py``; slime's TIS; Ling team's IcePop):

- **TIS** (truncated importance sampling), ``truncate``:
  token:    w_t = min(rho_t, C)
  sequence: w_t = min(prod_s rho_s, C) for every token t of the sequence (the product over
            the response, as verl's sequence-level IS weights).
- **MIS / IcePop** (masked importance sampling), ``mask``: a token whose ratio leaves
  [low, high] gets w_t = 0 (no gradient), the others keep their weight:
  token:    keep_t = low <= rho_t <= high
  sequence: keep = low <= exp(mean_s log rho_s) <= high for the whole sequence (the
            geometric mean, verl's "geometric" rejection: a product would reject every long
            sequence).
  Masked tokens stay in the loss's normaliser (IcePop's choice; the global token counts are
  reduced before the backward and do not depend on the weights).

Both switches combine: w_t = keep_t * min(rho, C) (rho the token's or the sequence's), or
keep_t alone when ``truncate`` is off. The PPO loss then reads w_t * max(-A r, -A clip(r)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Level = Literal["off", "token", "sequence"]
LEVELS: tuple[str, ...] = ("off", "token", "sequence")


@dataclass(frozen=True, kw_only=True)
class RolloutCorrectionConfig:
    """Importance correction of the policy loss for the rollout engine's sampling policy."""

    truncate: Level = "off"
    """TIS: weigh each token by min(rho, truncate_at), rho of the token or of the sequence; 'off'."""
    truncate_at: float = 2.0
    """C of TIS (slime and verl default to 2)."""
    mask: Level = "off"
    """MIS / IcePop: zero the weight where rho (token, or sequence geometric mean) leaves [mask_low, mask_high]."""
    mask_low: float = 0.5
    """Lower bound of the kept ratio (IcePop: 0.5)."""
    mask_high: float = 2.0
    """Upper bound of the kept ratio (IcePop: 2)."""

    def __post_init__(self) -> None:
        for name in ("truncate", "mask"):
            if getattr(self, name) not in LEVELS:
                raise ValueError(
                    f"rollout_correction.{name} must be one of {LEVELS}, got {getattr(self, name)!r}"
                )
        if self.truncate_at <= 0:
            raise ValueError(f"rollout_correction.truncate_at must be > 0, got {self.truncate_at}")
        if not 0 < self.mask_low < 1 < self.mask_high:
            raise ValueError(
                "rollout_correction needs 0 < mask_low < 1 < mask_high, got "
                f"{self.mask_low}, {self.mask_high}"
            )

    @property
    def enabled(self) -> bool:
        return self.truncate != "off" or self.mask != "off"


def rollout_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    offsets: torch.Tensor,
    cfg: RolloutCorrectionConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss weights w [N] float32 and the kept mask [N] bool (module docstring).

    old_logprobs, rollout_logprobs: [N], the response tokens of S sequences laid end to end;
    offsets: [S + 1] int64 (0, ..., N). Sequence-level terms sum over each sequence's tokens
    in float64. With ``cfg`` off: ones and all kept.
    """
    if old_logprobs.shape != rollout_logprobs.shape or old_logprobs.dim() != 1:
        raise ValueError(
            "rollout_weights needs old and rollout log-probs of one shape [N], got "
            f"{tuple(old_logprobs.shape)} and {tuple(rollout_logprobs.shape)}"
        )
    if int(offsets[-1]) != old_logprobs.numel():
        raise ValueError(
            f"offsets end at {int(offsets[-1])}, but there are {old_logprobs.numel()} tokens"
        )
    log_rho = old_logprobs.to(torch.float64) - rollout_logprobs.to(torch.float64)
    lengths = offsets.diff()
    seq_of_token = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=log_rho.device), lengths, output_size=log_rho.numel()
    )
    seq_sum = torch.zeros(lengths.numel(), dtype=torch.float64, device=log_rho.device)
    seq_sum.index_add_(0, seq_of_token, log_rho)
    per_seq = {
        "sum": seq_sum[seq_of_token],
        "mean": (seq_sum / lengths.clamp(min=1).to(torch.float64))[seq_of_token],
    }
    weight = torch.ones_like(log_rho)
    if cfg.truncate != "off":
        log_w = log_rho if cfg.truncate == "token" else per_seq["sum"]
        weight = torch.exp(log_w.clamp(max=torch.log(torch.tensor(cfg.truncate_at)).item()))
    keep = torch.ones_like(log_rho, dtype=torch.bool)
    if cfg.mask != "off":
        log_m = log_rho if cfg.mask == "token" else per_seq["mean"]
        ratio = torch.exp(log_m)
        keep = (ratio >= cfg.mask_low) & (ratio <= cfg.mask_high)
    return (weight * keep).to(torch.float32), keep


def correction_metrics(
    weight: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor, num_tokens: torch.Tensor | float
) -> dict[str, torch.Tensor]:
    """This shard's shares of the global token means of the weight and of the masked fraction.

    weight [*] (the loss weights), keep [*] bool, mask [*] (response tokens that count);
    num_tokens: the global response-token count (``losses.aggregate``'s normaliser).
    """
    count = num_tokens.clamp(min=1) if isinstance(num_tokens, torch.Tensor) else max(num_tokens, 1)
    share = mask.to(torch.float32) / count
    return {
        "rollout_is_weight": (weight.to(torch.float32) * share).sum(),
        "rollout_masked_frac": ((~keep.bool()).to(torch.float32) * share).sum(),
    }
