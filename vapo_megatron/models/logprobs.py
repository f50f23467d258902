"""Log-probs of given tokens and entropy from vocabulary-parallel logits.

Each tensor-parallel rank holds logits for its slice of the (padded) vocabulary. Two
all-reduces over the TP group give what is needed (the max, then the sums of exp, of exp * z
and the target's logit), never the full vocabulary on one rank. The backward pass needs no
communication: the gradient for a rank's logits only involves its own slice and the global
scalars saved in the forward pass.

Alignment: ``labels[..., i]`` is the token whose log-prob is read from ``logits[..., i, :]``,
i.e. the token *after* position i (DESIGN.md, "Positions"); the caller shifts tokens globally
before any context-parallel split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from vapo_megatron.parallel import collectives


def _all_reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        collectives.all_reduce(x, group, op)
    return x


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    """(log p(label), entropy) per position from a vocabulary slice; see the module docstring."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_start, vocab_size, temperature, group):
        z = (
            logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
        )  # [..., V_local]
        vocab_local = z.shape[-1]
        # Megatron pads the vocabulary to a multiple of 128 * TP; padded ids never count.
        real = (torch.arange(vocab_local, device=z.device) + vocab_start) < vocab_size  # [V_local]
        z = z.masked_fill(~real, float("-inf"))
        z_max = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group)
        shifted = z - z_max.unsqueeze(-1)
        exp = shifted.exp()
        local_label = labels - vocab_start
        in_slice = (local_label >= 0) & (local_label < vocab_local)
        label_logit = shifted.gather(
            -1, local_label.clamp(0, vocab_local - 1).unsqueeze(-1)
        ).squeeze(-1)
        sums = torch.stack(
            [
                exp.sum(-1),
                torch.where(real, exp * shifted, 0.0).sum(-1),
                torch.where(in_slice, label_logit, 0.0),
            ],
            dim=-1,
        )
        sum_exp, sum_exp_z, label_logit = _all_reduce(sums, dist.ReduceOp.SUM, group).unbind(-1)
        log_z = sum_exp.log()  # log partition function of the shifted logits
        logprob = label_logit - log_z
        entropy = log_z - sum_exp_z / sum_exp
        ctx.save_for_backward(shifted, log_z, entropy, local_label, in_slice, real)
        ctx.temperature = temperature
        ctx.input_dtype = logits.dtype
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        shifted, log_z, entropy, local_label, in_slice, real = ctx.saved_tensors
        log_p = shifted - log_z.unsqueeze(-1)
        p = log_p.exp()
        # d logp(label)/dz_j = 1[j = label] - p_j;  dH/dz_j = -p_j (log p_j + H).
        grad = -p * (
            grad_logprob.unsqueeze(-1)
            + grad_entropy.unsqueeze(-1) * (log_p + entropy.unsqueeze(-1))
        )
        grad = torch.where(real, grad, 0.0)  # p = 0 times log p = -inf on padded ids
        onehot_grad = torch.where(in_slice, grad_logprob, 0.0).unsqueeze(-1)
        grad.scatter_add_(
            -1, local_label.clamp(0, shifted.shape[-1] - 1).unsqueeze(-1), onehot_grad
        )
        return (grad / ctx.temperature).to(ctx.input_dtype), None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int,
    vocab_start: int = 0,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``labels`` and entropies under softmax(logits / temperature).

    logits: [..., V_local], this rank's vocabulary slice [vocab_start, vocab_start + V_local)
    of the full padded vocabulary; vocab_size: the real vocabulary size (the HF config's), ids at
    or above it are left out of the softmax, as HF and vLLM never see them; labels: [...] global
    token ids below vocab_size. Returns (logprobs [...], entropy [...]) in fp32 (fp64 for fp64 logits), both
    differentiable with respect to ``logits``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels {tuple(labels.shape)} must match logits {tuple(logits.shape)} without the vocab dim"
        )
    return _VocabParallelLogprobEntropy.apply(
        logits, labels, vocab_start, vocab_size, temperature, tp_group
    )


@dataclass(frozen=True)
class VocabSlice:
    """Where this rank's logits sit in the vocabulary: what log-probs need besides them."""

    tp_group: dist.ProcessGroup | None
    """The tensor-parallel group the vocabulary is split over (None: not split)."""
    vocab_size: int
    """Real vocabulary size (the HF config's); padded ids above it never count."""
    start: int = 0
    """First vocabulary id of this rank's logits."""

    def logprobs(
        self, logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`vocab_parallel_logprobs` of ``labels`` under this rank's ``logits``."""
        return vocab_parallel_logprobs(
            logits, labels, tp_group=self.tp_group, vocab_size=self.vocab_size,
            vocab_start=self.start, temperature=temperature,
        )  # fmt: skip
