"""Policy, value, NLL and entropy losses, as pure functions of tensors and global normalisers.

Shapes: every per-token argument has one common shape, written ``[*]`` ([N] packed or
[B, T] padded); ``mask`` marks the response tokens that count.

Normalisers are *global*: counted over the whole step's batch (all data- and context-parallel
ranks, all micro-batches) by ``parallel.reductions``. Each function returns this shard's share
of the global loss, so summing the shares of every rank and micro-batch gives the loss (and,
by linearity, the gradient) of the whole batch on one device. Metrics follow the same rule:
each is this shard's contribution to a global mean (sum them to get it).
"""

from __future__ import annotations

from typing import Literal

import torch

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: Aggregation,
    *,
    num_tokens: torch.Tensor | float,
    num_seqs: torch.Tensor | float | None = None,
    seq_num_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [*] to this shard's share of the global scalar.

    token-mean (VAPO, DAPO): sum over all response tokens / num_tokens (global token count).
    seq-mean-token-mean (vanilla PPO's sample-level loss): mean over sequences of each
    sequence's token mean; needs seq_num_tokens [*] (each token's full response length) and
    num_seqs (global sequence count).
    seq-mean-token-sum: sum over each sequence's tokens, averaged over sequences (num_seqs).
    """
    masked = per_token * mask
    if mode == "token-mean":
        return masked.sum() / _at_least_one(num_tokens)
    if num_seqs is None:
        raise ValueError(f"aggregation {mode!r} needs num_seqs, the global number of sequences")
    if mode == "seq-mean-token-sum":
        return masked.sum() / _at_least_one(num_seqs)
    if mode == "seq-mean-token-mean":
        if seq_num_tokens is None:
            raise ValueError("aggregation 'seq-mean-token-mean' needs seq_num_tokens per token")
        return (masked / seq_num_tokens.clamp(min=1)).sum() / _at_least_one(num_seqs)
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {AGGREGATIONS}")


def _at_least_one(count: torch.Tensor | float) -> torch.Tensor | float:
    # An empty global batch (e.g. no correct responses for the NLL term) gives a zero loss.
    return count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    aggregation: Aggregation,
    num_tokens: torch.Tensor | float,
    num_seqs: torch.Tensor | float | None = None,
    seq_num_tokens: torch.Tensor | None = None,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with clip-higher (ratio in [1 - eps_low, 1 + eps_high]).

    logprobs (with grad), old_logprobs, advantages, mask: [*]. dual_clip (c > 1) bounds the
    loss of negative-advantage tokens by -c * A (dual-clip PPO). Metrics (shares of global
    token means): clip_frac_low, clip_frac_high, dual_clip_frac, approx_kl (k3 estimator of
    KL(old || new)), ratio.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        low = (ratio < 1.0 - eps_low) & (advantages < 0)
        high = (ratio > 1.0 + eps_high) & (advantages > 0)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        with torch.no_grad():
            dual = (advantages < 0) & (per_token > bound)
        per_token = torch.where(advantages < 0, torch.minimum(per_token, bound), per_token)
    else:
        dual = torch.zeros_like(low)
    loss = aggregate(
        per_token,
        mask,
        aggregation,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        seq_num_tokens=seq_num_tokens,
    )
    with torch.no_grad():
        share = mask.to(ratio.dtype) / _at_least_one(num_tokens)
        metrics = {
            "clip_frac_low": (low * share).sum(),
            "clip_frac_high": (high * share).sum(),
            "dual_clip_frac": (dual * share).sum(),
            "approx_kl": (((ratio - 1.0) - log_ratio) * share).sum(),
            "ratio": (ratio * share).sum(),
        }
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_tokens: torch.Tensor | float,
    old_values: torch.Tensor | None = None,
    clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 * (V - R)^2, token-mean; with ``clip``, the PPO max against V clipped to old +- clip.

    values (with grad), returns, mask, old_values: [*]. Metrics: value_clip_frac.
    """
    error = (values - returns) ** 2
    clip_frac = torch.zeros((), dtype=values.dtype, device=values.device)
    if clip is not None:
        if old_values is None:
            raise ValueError("value clipping needs old_values (the scoring pass's values)")
        clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
        clipped_error = (clipped_values - returns) ** 2
        with torch.no_grad():
            clip_frac = ((clipped_error > error) * mask).sum() / _at_least_one(num_tokens)
        error = torch.maximum(error, clipped_error)
    loss = 0.5 * aggregate(error, mask, "token-mean", num_tokens=num_tokens)
    return loss, {"value_clip_frac": clip_frac}


def positive_nll_loss(
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    positive: torch.Tensor,
    *,
    num_positive_tokens: torch.Tensor | float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """VAPO's positive-example LM loss: -log p over tokens of correct responses.

    logprobs (with grad), mask: [*]; positive: [*] true on tokens of responses the verifier
    marked correct. Normalised by the global count of such tokens (0 if there are none).
    """
    selected = mask.bool() & positive.bool()
    loss = aggregate(-logprobs, selected, "token-mean", num_tokens=num_positive_tokens)
    return loss, {"nll_positive": loss.detach()}


def entropy_bonus(
    entropy: torch.Tensor, mask: torch.Tensor, *, num_tokens: torch.Tensor | float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-mean entropy [*] -> this shard's share of the global mean (to be maximised)."""
    mean = aggregate(entropy, mask, "token-mean", num_tokens=num_tokens)
    return mean, {"entropy": mean.detach()}


EV_MIN_RELATIVE_VARIANCE = 1e-8
"""explained_variance is NaN when Var(R) <= this * mean(R^2): the returns are constant up to
rounding (every reward equal under lambda = gamma = 1), and the ratio would only amplify noise."""


def explained_variance_stats(
    returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Sufficient statistics [5] float64 for explained variance; sum them across shards.

    returns, values, mask: [*]. Cast to float64 before any arithmetic, so R - V of float32
    inputs carries no float32 rounding.
    """
    m = mask.to(torch.float64)
    r = returns.detach().to(torch.float64) * m
    e = (returns.detach().to(torch.float64) - values.detach().to(torch.float64)) * m
    return torch.stack([m.sum(), r.sum(), (r * r).sum(), e.sum(), (e * e).sum()])


def explained_variance(stats: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over response tokens, from summed ``explained_variance_stats``.

    NaN (not a huge negative number) when the returns are constant up to rounding,
    Var(R) <= EV_MIN_RELATIVE_VARIANCE * max(mean(R^2), tiny): e.g. every reward equal under
    lambda = gamma = 1, where a variance of pure rounding noise (1e-20) would turn a critic
    error of 1e-8 into an "explained variance" of -1e12. Also NaN without response tokens.
    """
    n, r_sum, r_sq, e_sum, e_sq = stats.to(torch.float64).unbind()
    n = n.clamp(min=1)
    mean_sq = r_sq / n
    var_r = mean_sq - (r_sum / n) ** 2
    var_e = e_sq / n - (e_sum / n) ** 2
    floor = EV_MIN_RELATIVE_VARIANCE * mean_sq.clamp(min=torch.finfo(torch.float64).tiny)
    return torch.where(var_r > floor, 1 - var_e / var_r, torch.full_like(var_r, float("nan")))
