"""Log-probs of given tokens and entropy from vocabulary-parallel logits.

Each tensor-parallel rank holds logits for its slice of the (padded) vocabulary. Two
all-reduces over the TP group give what is needed (the max, then the sums of exp, of exp * z
and the target's logit), never the full vocabulary on one rank. The backward pass needs no
communication: the gradient for a rank's logits only involves its own slice and the global
scalars saved in the forward pass.

Memory: the fp32 work is done ``chunk_tokens`` positions at a time, and backward saves only
the input logits (their own dtype) and four scalars per position, recomputing each chunk's
softmax. The peak above the logits is then the gradient (the logits' size and dtype) plus one
chunk's temporaries, instead of about 24 bytes per logit element (tests/unit/models/test_logprobs.py,
``test_chunked_peak_memory``, measures both).

Alignment: ``labels[..., i]`` is the token whose log-prob is read from ``logits[..., i, :]``,
i.e. the token *after* position i (DESIGN.md, "Positions"); the caller shifts tokens globally
before any context-parallel split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from vapo_megatron.parallel import collectives

LOGPROB_CHUNK_TOKENS = 1024
"""Default positions per chunk: at ~19,000 local vocabulary entries (Qwen2.5 at TP8) the fp32
temporaries of one chunk are about 0.3 GiB, whatever the sequence length."""


def _all_reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        collectives.all_reduce(x, group, op)
    return x


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    """(log p(label), entropy) per position from a vocabulary slice; see the module docstring.

    Works through the tokens ``chunk_tokens`` rows at a time, so the fp32 temporaries (the
    upcast logits, their exp, exp * z) never exceed a chunk. Backward keeps only the input
    logits (in their own dtype) and per-token scalars, and recomputes each chunk's softmax.
    """

    @staticmethod
    def forward(ctx, logits, labels, vocab_start, vocab_size, temperature, group, chunk_tokens):
        vocab_local = logits.shape[-1]
        flat_logits = logits.reshape(-1, vocab_local)  # [N, V_local]
        flat_labels = labels.reshape(-1)  # [N]
        num_tokens = flat_logits.shape[0]
        dtype = torch.promote_types(logits.dtype, torch.float32)
        # Megatron pads the vocabulary to a multiple of 128 * TP; padded ids never count.
        real = (torch.arange(vocab_local, device=logits.device) + vocab_start) < vocab_size
        chunks = [
            (s, min(s + chunk_tokens, num_tokens)) for s in range(0, num_tokens, chunk_tokens)
        ]
        z_max = torch.empty(num_tokens, dtype=dtype, device=logits.device)  # [N]
        for s, e in chunks:
            z_max[s:e] = _scaled(flat_logits[s:e], real, temperature, dtype).max(dim=-1).values
        _all_reduce(z_max, dist.ReduceOp.MAX, group)
        local_label = flat_labels - vocab_start  # [N]
        in_slice = (local_label >= 0) & (local_label < vocab_local)
        # [N, 1] int64 (labels may come as int32, packing.IDS; torch 2.13's gather takes
        # either, and int64 is what every version takes)
        label_index = local_label.clamp(0, vocab_local - 1).long().unsqueeze(-1)
        sums = torch.empty(num_tokens, 3, dtype=dtype, device=logits.device)  # [N, 3]
        for s, e in chunks:
            shifted = _scaled(flat_logits[s:e], real, temperature, dtype) - z_max[s:e, None]
            exp = shifted.exp()
            label_logit = shifted.gather(-1, label_index[s:e]).squeeze(-1)
            sums[s:e, 0] = exp.sum(-1)
            sums[s:e, 1] = torch.where(real, exp * shifted, 0.0).sum(-1)
            sums[s:e, 2] = torch.where(in_slice[s:e], label_logit, 0.0)
            del shifted, exp
        sum_exp, sum_exp_z, label_logit = _all_reduce(sums, dist.ReduceOp.SUM, group).unbind(-1)
        log_z = sum_exp.log()  # log partition function of the shifted logits
        logprob = label_logit - log_z
        entropy = log_z - sum_exp_z / sum_exp
        ctx.save_for_backward(flat_logits, z_max, log_z, entropy, label_index, in_slice, real)
        ctx.temperature, ctx.chunks, ctx.logits_shape = temperature, chunks, logits.shape
        return logprob.view(labels.shape), entropy.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        flat_logits, z_max, log_z, entropy, label_index, in_slice, real = ctx.saved_tensors
        grad_logprob, grad_entropy = grad_logprob.reshape(-1), grad_entropy.reshape(-1)  # [N]
        grad_logits = torch.empty_like(flat_logits)  # [N, V_local], the input's dtype
        dtype = z_max.dtype
        for s, e in ctx.chunks:
            shifted = _scaled(flat_logits[s:e], real, ctx.temperature, dtype) - z_max[s:e, None]
            log_p = shifted - log_z[s:e, None]
            del shifted
            # d logp(label)/dz_j = 1[j = label] - p_j;  dH/dz_j = -p_j (log p_j + H).
            grad = -log_p.exp() * (
                grad_logprob[s:e, None] + grad_entropy[s:e, None] * (log_p + entropy[s:e, None])
            )
            del log_p
            grad = torch.where(real, grad, 0.0)  # p = 0 times log p = -inf on padded ids
            onehot_grad = torch.where(in_slice[s:e], grad_logprob[s:e], 0.0).unsqueeze(-1)
            grad.scatter_add_(-1, label_index[s:e], onehot_grad)
            grad_logits[s:e] = grad / ctx.temperature
            del grad
        return grad_logits.view(ctx.logits_shape), None, None, None, None, None, None


def _scaled(
    logits: torch.Tensor, real: torch.Tensor, temperature: float, dtype: torch.dtype
) -> torch.Tensor:
    """logits [n, V_local] -> fp32 (at least) logits / temperature, -inf on padded ids."""
    return (logits.to(dtype) / temperature).masked_fill(~real, float("-inf"))


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int,
    vocab_start: int = 0,
    temperature: float = 1.0,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``labels`` and entropies under softmax(logits / temperature).

    logits: [..., V_local], this rank's vocabulary slice [vocab_start, vocab_start + V_local)
    of the full padded vocabulary; vocab_size: the real vocabulary size (the HF config's), ids at
    or above it are left out of the softmax, as HF and vLLM never see them; labels: [...] global
    token ids below vocab_size; chunk_tokens: how many positions are worked on at once (the
    fp32 temporaries are about 16 bytes x chunk_tokens x V_local; the results do not depend
    on it). Returns (logprobs [...], entropy [...]) in fp32 (fp64 for fp64 logits), both
    differentiable with respect to ``logits``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels {tuple(labels.shape)} must match logits {tuple(logits.shape)} without the vocab dim"
        )
    return _VocabParallelLogprobEntropy.apply(
        logits, labels, vocab_start, vocab_size, temperature, tp_group, chunk_tokens
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
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS
    """Positions worked on at once; bounds the fp32 temporaries (see vocab_parallel_logprobs)."""

    def logprobs(
        self, logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`vocab_parallel_logprobs` of ``labels`` under this rank's ``logits``."""
        return vocab_parallel_logprobs(
            logits, labels, tp_group=self.tp_group, vocab_size=self.vocab_size,
            vocab_start=self.start, temperature=temperature, chunk_tokens=self.chunk_tokens,
        )  # fmt: skip
