"""Loss functions that join a model's output to the algorithm's losses, per micro-batch.

Micro-batch fields used (label-aligned, see ``data/packing.py``): ``old_logprobs``,
``advantages``, ``returns``, ``old_values``, ``positive`` (token of a correct response) and
``seq_num_tokens`` (the token's response length, for sample-level aggregation); with the
rollout correction on, ``rollout_weight`` and ``rollout_keep`` (``step/updates.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

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
from vapo_megatron.models.mtp import MTPOutput, mtp_targets, split_output
from vapo_megatron.parallel.reductions import LossNormalisers


def policy_loss_fn(
    cfg: AlgoConfig,
    norm: LossNormalisers,
    vocab: VocabSlice,
    *,
    temperature: float = 1.0,
    mtp_loss_weight: float = 0.0,
):
    """PPO (clip-higher) + mu * positive-example NLL - entropy_coef * entropy, as a share;
    with MTP layers in the model (``mtp_loss_weight`` > 0), + the weight x their loss
    (:func:`mtp_loss`)."""

    def loss_fn(output: torch.Tensor | MTPOutput, mb: MicroBatch):
        logits, heads = split_output(output)
        loss, metrics = _policy_terms(cfg, norm, vocab, temperature, logits, mb)
        if heads:
            mtp, mtp_metrics = mtp_loss(vocab, heads, mb, num_tokens=norm.num_tokens)
            loss = loss + mtp_loss_weight * mtp
            metrics.update(mtp_metrics)
        return loss, metrics

    return loss_fn


def mtp_loss(
    vocab: VocabSlice, heads: Sequence[torch.Tensor], mb: MicroBatch, *, num_tokens: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The MTP layers' loss share: the mean over depths of each depth's cross-entropy on the
    rollout's own response tokens (depth k at position t predicts token t + 2 + k: the label
    of position t + 1 + k, where that is a response token of t's sequence), summed over this
    micro-batch and divided by the global response-token count ``num_tokens`` (the PPO
    term's normaliser; each sequence's last k + 1 tokens have no depth-k target). Temperature
    1: the heads are trained as predictors, not samplers. ``heads``: [b, s, V/tp] logits per
    depth (``MTPGPTModel``); the metric ``mtp_loss`` is the unweighted share."""
    packed = mb.packed_seq_params
    cu = None if packed is None else packed.cu_seqlens_q_padded
    total = heads[0].new_zeros((), dtype=torch.float32)
    for depth, logits in enumerate(heads):
        labels, mask = mtp_targets(mb.labels, mb.response_mask, depth, cu)
        logp, _ = vocab.logprobs(logits, labels, 1.0)
        total = total - (logp * mask).sum() / num_tokens
    total = total / len(heads)
    return total, {"mtp_loss": total.detach()}


def _policy_terms(
    cfg: AlgoConfig,
    norm: LossNormalisers,
    vocab: VocabSlice,
    temperature: float,
    logits: torch.Tensor,
    mb: MicroBatch,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss share of the main head's ``logits`` [b, s, V/tp]."""
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
        metrics.update(correction_metrics(weight, mb.fields["rollout_keep"], mask, norm.num_tokens))
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
