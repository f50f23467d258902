"""From an AlgoConfig to per-sequence lambdas and to advantages and critic targets."""

from __future__ import annotations

import torch

from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.algorithms.gae import (
    gae_packed_lambdas,
    gae_padded,
    length_adaptive_lambda,
    packed_returns,
)
from vapo_megatron.algorithms.masks import all_true


def gae_lambdas(
    cfg: AlgoConfig, num_response_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lambda_policy [B], lambda_critic [B]) for sequences of the given response lengths [B].

    Lengths are full-sequence counts (not a context-parallel shard's).
    """
    batch, device = num_response_tokens.shape[0], num_response_tokens.device
    if cfg.length_adaptive_alpha is not None:
        lam_policy = length_adaptive_lambda(num_response_tokens, cfg.length_adaptive_alpha)
    else:
        lam_policy = torch.full((batch,), cfg.lambda_policy, dtype=torch.float64, device=device)
    lam_critic = (
        torch.full((batch,), cfg.lambda_critic, dtype=torch.float64, device=device)
        if cfg.decoupled_gae
        else lam_policy
    )
    return lam_policy, lam_critic


def decoupled_gae_padded(
    cfg: AlgoConfig,
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    ratios: torch.Tensor | None = None,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Policy advantages and critic returns for a padded batch [B, T].

    ratios: None, or [B, T] pi_old / mu per token: both lambdas then take the same truncated
    importance traces (V-trace with lambda, ``gae.py``'s docstring; the returns are the
    V-trace targets). Returns (advantages [B, T], returns [B, T], lambda_policy [B]).
    """
    lam_policy, lam_critic = gae_lambdas(cfg, response_mask.sum(1))
    traces = {"ratios": ratios, "rho_bar": rho_bar, "c_bar": c_bar}
    advantages, _ = gae_padded(rewards, values, response_mask, lam_policy, cfg.gamma, **traces)
    _, returns = gae_padded(rewards, values, response_mask, lam_critic, cfg.gamma, **traces)
    return advantages, returns, lam_policy


def decoupled_gae_packed(
    cfg: AlgoConfig,
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    ratios: torch.Tensor | None = None,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As :func:`decoupled_gae_padded` for packed sequences [N] with boundaries cu_seqlens [S + 1]
    (ratios: None or [N]).

    Both lambdas run in one scan over the tokens, with no padding to the longest sequence.
    """
    cu_seqlens = cu_seqlens.to(rewards.device)
    if all_true(response_mask):
        lengths = cu_seqlens.diff()
    else:
        lengths = torch.nn.functional.pad(response_mask.bool().cumsum(0), (1, 0))[cu_seqlens].diff()
    lam_policy, lam_critic = gae_lambdas(cfg, lengths)
    lams = lam_policy[None] if lam_critic is lam_policy else torch.stack([lam_policy, lam_critic])
    advantages = gae_packed_lambdas(
        rewards, values, response_mask, cu_seqlens, lams, cfg.gamma,
        ratios=ratios, rho_bar=rho_bar, c_bar=c_bar,
    )  # fmt: skip
    if advantages.shape[0] == 1:  # one lambda: the returns need their own buffer
        return advantages[0], packed_returns(advantages[0], values, response_mask), lam_policy
    # The critic's row becomes the returns in place: the two results share one [2, N] buffer.
    returns = advantages[1]
    values = values.to(returns.dtype)
    if all_true(response_mask):
        returns.add_(values)
    else:
        returns.addcmul_(values, response_mask.to(returns.dtype))
    return advantages[0], returns, lam_policy
