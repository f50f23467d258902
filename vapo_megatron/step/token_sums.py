"""float64 statistics over the step's response tokens wherever they are held.

A rank holds some samples' per-token outputs (``HeldTokens``: its own samples, or the whole
step in a reference scorer) and counts some of those tokens (each token once over the
job); ``TokenSums`` sums over the counted tokens and all-reduces the sums over the host group.
The step's statistics (log-prob gap, explained variance, value and return means over all
tokens and at each response's first token, the whitening's and the advantages' mean and std)
are written once on top of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vapo_megatron.algorithms.losses import explained_variance
from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.devices import HOST

STAT_BLOCK = 1 << 20
"""Tokens per block of the float64 statistics."""


@dataclass
class HeldTokens:
    """The samples whose per-token outputs this rank holds, their response tokens laid end to
    end in its buffers (in ascending sample order)."""

    ids: torch.Tensor
    """[K] int64 the held samples, ascending."""
    start: list[int]
    """[S] first position of each held sample's tokens in the buffers (0 for the others)."""
    num_tokens: int
    """Response tokens of the held samples (the buffers' length)."""

    def offsets(self, response_lengths: torch.Tensor) -> torch.Tensor:
        """[K + 1] the held samples' spans in the buffers (cu_seqlens); ``response_lengths``:
        [S] of the whole step."""
        return torch.nn.functional.pad(response_lengths[self.ids].cumsum(0), (1, 0))


class TokenSums:
    """float64 sums over the tokens ``counting`` marks on this rank (None: all), all-reduced
    over ``group`` (None: this rank holds every token). Every rank gets the same totals."""

    def __init__(self, counting: torch.Tensor | None, group: dist.ProcessGroup | None):
        self.counting, self.group = counting, group

    def pick(self, x: torch.Tensor) -> torch.Tensor:
        """The counted tokens of ``x`` (all of them without a ``counting`` mask)."""
        return x if self.counting is None else x[self.counting]

    def total(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        out = torch.stack([p.to(HOST, torch.float64) for p in parts])
        if self.group is not None:
            collectives.all_reduce(out, self.group)
        return out

    def mean_std(self, x: torch.Tensor) -> tuple[float, float]:
        """Mean and unbiased std of ``x`` over the counted tokens (two passes, float64)."""
        picked = self.pick(x)
        n, s = self.total(
            [
                torch.tensor(picked.numel(), dtype=torch.float64, device=HOST),
                picked.sum(dtype=torch.float64),
            ]
        )
        count = int(n)
        if count == 0:
            return 0.0, 0.0
        mean = s.item() / count
        squares = torch.zeros((), dtype=torch.float64, device=HOST)
        for block in picked.split(STAT_BLOCK):
            squares += block.double().sub_(mean).square_().sum()  # one float64 temporary
        (squares,) = self.total([squares])
        return mean, math.sqrt(squares.item() / (count - 1)) if count > 1 else 0.0


def lambda_metrics(lam_policy: torch.Tensor) -> dict[str, float]:
    return {
        "lambda_policy/mean": lam_policy.double().mean().item(),
        "lambda_policy/min": lam_policy.min().item(),
        "lambda_policy/max": lam_policy.max().item(),
    }


def critic_metrics(
    sums: TokenSums, returns: torch.Tensor, values: torch.Tensor, total: int
) -> dict[str, float]:
    """Explained variance and the means of values and returns over the step's tokens: the
    sums of ``explained_variance_stats`` in float64, in blocks (no float64 copy of the whole
    buffer)."""
    r, v = sums.pick(returns), sums.pick(values)
    stats = torch.zeros(5, dtype=torch.float64, device=HOST)
    for rb, vb in zip(r.split(STAT_BLOCK), v.split(STAT_BLOCK), strict=True):
        r64 = rb.double()
        e64 = r64 - vb  # R - V in float64 (the values promote): no float32 rounding
        stats += torch.stack(
            [torch.tensor(float(rb.numel()), dtype=torch.float64, device=HOST), r64.sum(),
             r64.dot(r64), e64.sum(), e64.dot(e64)]
        )  # fmt: skip
    totals = sums.total(list(stats))
    r_sum, e_sum = totals[1].item(), totals[3].item()
    return {
        "critic/explained_variance": explained_variance(totals).item(),
        "critic/values_mean": (r_sum - e_sum) / total,  # sum V = sum R - sum (R - V)
        "critic/returns_mean": r_sum / total,
    }


PROFILE_POINTS = {"q1": 0.25, "half": 0.5, "q3": 0.75, "last": 1.0}
"""Positions along a response past its first token (``profile_metrics``): token
round(f (R - 1)) of a response of R tokens."""


def first_token_metrics(
    sums: TokenSums, held: HeldTokens, returns: torch.Tensor, values: torch.Tensor
) -> dict[str, float]:
    """Means over the step's samples of the critic's value and of the return at each
    response's first token (V(s_0), the state after the prompt, against its target): the
    bias a critic started from a reward model carries before the early tokens' values are
    fitted. ``returns``, ``values``: [held.num_tokens] the held samples' buffers. A sample's
    first token is counted where ``sums`` counts it (once over the job), so any layout gives
    the same means."""
    first = torch.tensor([held.start[i] for i in held.ids.tolist()], dtype=torch.long, device=HOST)
    v, r = _means_at(sums, first, values, returns)
    return {"critic/value_first_token": v, "critic/return_first_token": r}


def profile_metrics(
    sums: TokenSums,
    held: HeldTokens,
    response_lengths: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
) -> dict[str, float]:
    """The critic's value and the return along the responses (``critic/value_<point>``,
    ``critic/return_<point>`` at each of ``PROFILE_POINTS``; the first token is
    ``first_token_metrics``'): the shape of a reward model's bias (too low early and rising
    toward the end reads as "better than expected" at every token). ``response_lengths``: [S]
    of the whole step; the buffers as ``first_token_metrics``'; any layout gives the same
    means."""
    ids = held.ids.tolist()
    lengths = response_lengths[held.ids].tolist()
    parts = []
    for fraction in PROFILE_POINTS.values():
        at = [held.start[i] + round(fraction * (n - 1)) for i, n in zip(ids, lengths, strict=True)]
        parts += _sums_at(sums, torch.tensor(at, dtype=torch.long, device=HOST), values, returns)
    totals = sums.total(parts).view(-1, 3).tolist()  # one all-reduce for every point
    out = {}
    for name, (n, v, r) in zip(PROFILE_POINTS, totals, strict=True):
        out[f"critic/value_{name}"] = v / max(n, 1.0)
        out[f"critic/return_{name}"] = r / max(n, 1.0)
    return out


def failing_advantage_metrics(
    sums: TokenSums,
    held: HeldTokens,
    response_lengths: torch.Tensor,
    advantages: torch.Tensor,
    rewards: torch.Tensor,
) -> dict[str, float]:
    """``advantages/positive_share_failing``: the share of the failing responses' tokens
    (reward <= 0) whose advantage is positive, before whitening: the paper's symptom of a
    value model biased low early (every rise of the value reads as "better than expected",
    so wrong answers are reinforced); ``advantages/positive_share_passing`` the same for the
    others. ``rewards``: [S] of the whole step; ``advantages``: [held.num_tokens]."""
    failing = torch.repeat_interleave(
        rewards[held.ids] <= 0, response_lengths[held.ids], output_size=held.num_tokens
    )
    positive = advantages > 0
    fail, pos = sums.pick(failing), sums.pick(positive)
    n_fail, n_fail_pos, n_pass, n_pass_pos = sums.total(
        [
            fail.sum(dtype=torch.float64),
            (fail & pos).sum(dtype=torch.float64),
            (~fail).sum(dtype=torch.float64),
            (~fail & pos).sum(dtype=torch.float64),
        ]
    )
    return {
        "advantages/positive_share_failing": n_fail_pos.item() / max(n_fail.item(), 1.0),
        "advantages/positive_share_passing": n_pass_pos.item() / max(n_pass.item(), 1.0),
    }


def _means_at(
    sums: TokenSums, index: torch.Tensor, values: torch.Tensor, returns: torch.Tensor
) -> tuple[float, float]:
    """Means of ``values`` and ``returns`` at buffer positions ``index`` (one a sample),
    each counted where ``sums`` counts it."""
    n, v, r = sums.total(_sums_at(sums, index, values, returns)).tolist()
    return v / max(n, 1.0), r / max(n, 1.0)


def _sums_at(
    sums: TokenSums, index: torch.Tensor, values: torch.Tensor, returns: torch.Tensor
) -> list[torch.Tensor]:
    """This rank's count and float64 sums of ``values`` and ``returns`` at ``index``, where
    ``sums`` counts."""
    if sums.counting is not None:
        index = index[sums.counting[index]]
    return [
        torch.tensor(index.numel(), dtype=torch.float64, device=HOST),
        values[index].sum(dtype=torch.float64),
        returns[index].sum(dtype=torch.float64),
    ]


def logprob_gap_sum(
    rollout: torch.Tensor,
    old_logprobs: torch.Tensor,
    held: HeldTokens,
    offsets: torch.Tensor,
    sums: TokenSums,
) -> torch.Tensor:
    """float64 sum of |exp(rollout - old) - 1| over this rank's counted tokens, in blocks of
    about ``STAT_BLOCK`` tokens. ``rollout`` [N]: the step's flat buffer (offsets [S + 1]);
    ``old_logprobs``: this rank's buffer of the ``held`` samples' tokens."""
    total = torch.zeros((), dtype=torch.float64, device=HOST)
    ids = held.ids.tolist()
    flat = offsets.tolist()
    block, first, used = [], 0, 0
    for k, i in enumerate(ids):  # blocks of whole samples: their slices laid end to end
        block.append(rollout[flat[i] : flat[i + 1]])
        used += flat[i + 1] - flat[i]
        if used < STAT_BLOCK and k + 1 < len(ids):
            continue
        span = slice(held.start[ids[first]], held.start[ids[first]] + used)
        gap = torch.cat(block).sub_(old_logprobs[span]).exp_().sub_(1).abs_()
        if sums.counting is not None:
            gap = gap[sums.counting[span]]
        total += gap.sum(dtype=torch.float64)
        block, first, used = [], k + 1, 0
    return total
