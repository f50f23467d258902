"""Value-free baselines: group-mean advantages (GRPO, DAPO), dynamic sampling, overlong shaping.

Samples of one prompt are consecutive: rows [g * n, (g + 1) * n) form group g.
"""

from __future__ import annotations

import torch


def _groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    if scores.dim() != 1 or group_size < 1 or scores.numel() % group_size != 0:
        raise ValueError(
            f"scores must be [num_groups * group_size]; got shape {tuple(scores.shape)} "
            f"with group_size={group_size}"
        )
    return scores.view(-1, group_size)


def group_normalized_advantages(
    scores: torch.Tensor, group_size: int, *, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """(r - mean_group) / (std_group + eps) per sample; scores [B] -> advantages [B].

    GRPO and DAPO use the unbiased group std; ``scale_by_std=False`` gives the mean-only
    baseline (Dr. GRPO). A group whose scores are all equal gets advantage 0.
    """
    grouped = _groups(scores.to(torch.float32), group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std and group_size > 1:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def dynamic_sampling_keep(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO's filter: True [B] for samples of groups whose scores are not all equal."""
    grouped = _groups(scores, group_size)
    varied = (grouped != grouped[:, :1]).any(dim=1)
    return varied.repeat_interleave(group_size)


def soft_overlong_penalty(
    response_lengths: torch.Tensor, max_response_len: int, buffer_len: int
) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the score. lengths [B] -> penalty [B].

    0 up to max_response_len - buffer_len, then falling linearly to -1 at max_response_len,
    and -1 beyond it.
    """
    if not 0 < buffer_len <= max_response_len:
        raise ValueError(
            f"overlong buffer_len must lie in (0, max_response_len={max_response_len}], got {buffer_len}"
        )
    expected = max_response_len - buffer_len
    over = (response_lengths.to(torch.float32) - expected).clamp(min=0)
    return (-over / buffer_len).clamp(min=-1.0)
