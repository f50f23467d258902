"""Global loss normalisers and metric sums across data- and context-parallel ranks.

Token-level losses are sums over the whole step's batch divided by its token count. Each rank
counts its own tokens over all of its micro-batches, and one all-reduce over the data x context
parallel group gives the global counts *before* any backward pass; every micro-batch's loss is
then its sum divided by those counts, so the accumulated gradient, summed over ranks, is the
single-device gradient of the global batch (however the batch was split).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vapo_megatron.parallel import collectives


@dataclass(frozen=True)
class LossNormalisers:
    """Global counts of one step's batch (float64 scalars)."""

    num_tokens: torch.Tensor
    """Response tokens (the token-mean normaliser)."""
    num_seqs: torch.Tensor
    """Sequences (the sample-level normaliser)."""
    num_positive_tokens: torch.Tensor
    """Response tokens of correct responses (the positive-example NLL normaliser)."""


def global_loss_normalisers(
    response_masks: Sequence[torch.Tensor],
    positive_masks: Sequence[torch.Tensor | None],
    num_seqs: int,
    *,
    dp_cp_group: dist.ProcessGroup | None,
    cp_size: int,
    device: torch.device,
) -> LossNormalisers:
    """Count this rank's tokens over all its micro-batches and sum over ``dp_cp_group``.

    response_masks[i], positive_masks[i]: micro-batch i's masks (any shape, same per i; a
    positive mask None: no correct response in it, e.g. the critic's micro-batches). Counted
    on the masks' device by ``count_nonzero`` (``algorithms/masks.py``: a bool ``sum`` is ~20x
    slower on the host, where the step counts thousands of micro-batches).
    num_seqs: sequences this rank's data-parallel replica trains on. Every context-parallel
    rank of a replica holds a shard of the same sequences, so the sum over the group counts
    each sequence cp_size times and is divided by cp_size. ``device``: the model's (the counts
    meet its losses, and the group's backend may be NCCL); the masks may be anywhere.
    """
    if len(response_masks) != len(positive_masks):
        raise ValueError(
            f"got {len(response_masks)} response masks but {len(positive_masks)} positive masks"
        )
    if not response_masks:
        raise ValueError(
            "global_loss_normalisers needs at least one micro-batch; give a rank without data "
            "one empty mask"
        )
    # Counted where the masks are, with no sync; one copy to ``device``.
    zero = torch.zeros((), dtype=torch.long, device=response_masks[0].device)
    num_tokens = sum((torch.count_nonzero(mask) for mask in response_masks), zero)
    num_positive = sum(
        (
            torch.count_nonzero(mask.bool() & positive.bool())
            for mask, positive in zip(response_masks, positive_masks, strict=True)
            if positive is not None
        ),
        zero,
    )
    counts = torch.stack([num_tokens, zero + num_seqs, num_positive]).to(device, torch.float64)
    if dp_cp_group is not None:
        collectives.all_reduce(counts, dp_cp_group)
    counts[1] /= cp_size
    return LossNormalisers(num_tokens=counts[0], num_seqs=counts[1], num_positive_tokens=counts[2])


def sum_metrics(
    metrics: dict[str, torch.Tensor], group: dist.ProcessGroup | None
) -> dict[str, float]:
    """Sum each metric (a share of a global mean) over ``group``; one all-reduce for all."""
    names = sorted(metrics)
    if not names:
        return {}
    stacked = torch.stack([metrics[n].detach().to(torch.float64).reshape(()) for n in names])
    if group is not None:
        collectives.all_reduce(stacked, group)
    return dict(zip(names, stacked.tolist(), strict=True))
