"""Rewards and values of the step's flat response tokens -> advantages and critic targets.

Runs on every rank over the whole step (the scoring pass gathered every token's value), so
its result does not depend on any model's layout. The reward sits at each response's last
token (the state after it is terminal, value 0); GAE uses lambda_policy(l) per sequence for
advantages and lambda_critic for returns; the group estimator (GRPO/DAPO) broadcasts each
sample's group-normalised score over its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vapo_megatron.algorithms.advantages import decoupled_gae_packed
from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.algorithms.group_advantages import group_normalized_advantages


def terminal_rewards(
    rewards: Sequence[float] | torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """[N] zeros with rewards[i] at sample i's last response token (offsets: [S + 1])."""
    flat = torch.zeros(int(offsets[-1]), dtype=torch.float32, device=offsets.device)
    if (offsets.diff() < 1).any():
        raise ValueError("every sample needs at least one response token to carry its reward")
    flat[offsets[1:] - 1] = torch.as_tensor(rewards, dtype=torch.float32, device=offsets.device)
    return flat


def gae_advantages(
    algo: AlgoConfig,
    rewards: Sequence[float] | torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(advantages [N], returns [N], lambda_policy [S]) from the critic's values [N]."""
    flat_rewards = terminal_rewards(rewards, offsets)
    mask = torch.ones_like(flat_rewards, dtype=torch.bool)
    return decoupled_gae_packed(algo, flat_rewards, values, mask, offsets)


def monte_carlo_returns(
    rewards: Sequence[float] | torch.Tensor, values: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """Critic-pretraining targets: returns with lambda = gamma = 1 (the Monte-Carlo return)."""
    mc = AlgoConfig(
        lambda_critic=1.0, gamma=1.0, decoupled_gae=True, length_adaptive_alpha=None,
        value_pretrain_steps=0,
    )  # fmt: skip
    _, returns, _ = gae_advantages(mc, rewards, values, offsets)
    return returns


def group_advantages(
    algo: AlgoConfig, rewards: Sequence[float] | torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """[N]: each sample's group-normalised reward on all of its tokens (GRPO / DAPO)."""
    per_sample = group_normalized_advantages(
        torch.as_tensor(rewards, dtype=torch.float32, device=offsets.device),
        algo.samples_per_prompt,
        scale_by_std=algo.group_scale_by_std,
    )  # fmt: skip
    return torch.repeat_interleave(per_sample, offsets.diff())


def whiten(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Zero mean, unit std over all of the step's response tokens (the global batch)."""
    if x.numel() < 2:
        return x - x.mean() if x.numel() else x
    return (x - x.mean()) / (x.std() + eps)
