"""Loss functions that join a model's output to the algorithm's losses, per micro-batch.

Micro-batch fields used (label-aligned, see ``data/packing.py``): ``old_logprobs``,
``advantages``, ``returns``, ``old_values``, ``positive`` (token of a correct response) and
``seq_num_tokens`` (the token's response length, for sample-level aggregation); with the
rollout correction on, ``rollout_weight`` and ``rollout_keep`` (``step/updates.py``).
"""

from __future__ import annotations

import torch

from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.algorithms.losses import (
    entropy_bonus,
    policy_loss,
    positive_nll_loss,
    value_loss,
)
from vapo_megatron.algorithms.rollout_correction import correction_metrics
from vapo_megatron.data.packing import MicroBatch
from vapo_megatron.models.logprobs import VocabSlice
from vapo_megatron.parallel.reductions import LossNormalisers


def policy_loss_fn(
    cfg: AlgoConfig, norm: LossNormalisers, vocab: VocabSlice, *, temperature: float = 1.0
):
    """PPO (clip-higher) + mu * positive-example NLL - entropy_coef * entropy, as a share."""

    def loss_fn(logits: torch.Tensor, mb: MicroBatch):
        logp, entropy = vocab.logprobs(logits, mb.labels, temperature)
        mask = mb.response_mask
        # Rollout correction (algorithms/rollout_correction.py): the PPO term's per-token
        # weight rides in its mask, so every aggregation weighs the token's loss by it and
        # the PPO metrics become importance-weighted means (masked tokens count in none).
        weight = mb.fields.get("rollout_weight")
        loss, metrics = policy_loss(
            logp,
            mb.fields["old_logprobs"],
            mb.fields["advantages"],
            mask if weight is None else mask * weight,
            eps_low=cfg.eps_low,
            eps_high=cfg.eps_high,
            dual_clip=cfg.dual_clip,
            aggregation=cfg.loss_aggregation,
            num_tokens=norm.num_tokens,
            num_seqs=norm.num_seqs,
            seq_num_tokens=mb.fields.get("seq_num_tokens"),
        )
        metrics["pg_loss"] = loss.detach()
        if weight is not None:
            metrics.update(
                correction_metrics(weight, mb.fields["rollout_keep"], mask, norm.num_tokens)
            )
        if cfg.positive_nll_coef:
            nll, nll_metrics = positive_nll_loss(
                logp, mask, mb.fields["positive"], num_positive_tokens=norm.num_positive_tokens
            )
            loss = loss + cfg.positive_nll_coef * nll
            metrics.update(nll_metrics)
        # Always reported; differentiated only when it is part of the loss.
        mean_entropy, entropy_metrics = entropy_bonus(
            entropy if cfg.entropy_coef else entropy.detach(), mask, num_tokens=norm.num_tokens
        )
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * mean_entropy
        metrics.update(entropy_metrics)
        return loss, metrics

    return loss_fn


def value_loss_fn(cfg: AlgoConfig, norm: LossNormalisers):
    """Critic loss share: 0.5 * (V - R)^2 token-mean, optionally clipped."""

    def loss_fn(values: torch.Tensor, mb: MicroBatch):
        loss, metrics = value_loss(
            values.squeeze(-1),
            mb.fields["returns"],
            mb.response_mask,
            num_tokens=norm.num_tokens,
            old_values=mb.fields.get("old_values"),
            clip=cfg.value_clip,
        )
        metrics["value_loss"] = loss.detach()
        return loss, metrics

    return loss_fn


def logprob_scoring_fn(vocab: VocabSlice, *, temperature: float = 1.0):
    """Forward-only: per-token log-probs [b, s] (and entropy) of the labels, in the metrics."""

    def loss_fn(logits: torch.Tensor, mb: MicroBatch):
        logp, entropy = vocab.logprobs(logits, mb.labels, temperature)
        zero = logits.new_zeros((), dtype=torch.float32)
        return zero, {"logprobs": logp.detach(), "entropy": entropy.detach()}

    return loss_fn


def value_scoring_fn():
    """Forward-only: per-token values [b, s] in the metrics."""

    def loss_fn(values: torch.Tensor, mb: MicroBatch):
        return values.new_zeros(()), {"values": values.squeeze(-1).detach()}

    return loss_fn
