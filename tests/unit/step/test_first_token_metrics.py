"""The critic's value and return at each response's first token (``first_token_metrics``):
the same means whichever rank holds or counts the tokens (issue 29)."""

from __future__ import annotations

import pytest
import torch

from vapo_megatron.step.token_sums import (
    PROFILE_POINTS,
    HeldTokens,
    TokenSums,
    failing_advantage_metrics,
    first_token_metrics,
    profile_metrics,
)

pytestmark = pytest.mark.unit

LENGTHS = [3, 1, 4, 2]
"""Response tokens of the step's four samples."""


class TwoRankSums(TokenSums):
    """TokenSums of one of two simulated ranks: ``total`` keeps this rank's local totals
    (``local``) and adds the other rank's (``other``, once known): an all-reduce over two."""

    def __init__(self, counting, other=None):
        super().__init__(counting, None)
        self.other, self.local = other, None

    def total(self, parts):
        self.local = super().total(parts)
        return self.local if self.other is None else self.local + self.other


def held_of(ids):
    """HeldTokens of ``ids``, their tokens end to end."""
    start, at = [0] * len(LENGTHS), 0
    for i in ids:
        start[i], at = at, at + LENGTHS[i]
    return HeldTokens(torch.tensor(ids), start, at)


def buffers(ids, keep=None):
    """(returns, values) of the held ``ids``, from the step's flat tokens; ``keep``: a mask of
    the positions this rank wrote (0 elsewhere, as a CP rank's buffers)."""
    torch.manual_seed(0)
    returns, values = torch.randn(sum(LENGTHS)), torch.randn(sum(LENGTHS))
    offsets = torch.tensor([0, *LENGTHS]).cumsum(0).tolist()
    index = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in ids])
    r, v = returns[index], values[index]
    if keep is not None:
        r, v = r * keep, v * keep
    return r, v, returns[offsets[:-1]], values[offsets[:-1]]


def two_ranks(layouts):
    """first_token_metrics on two simulated ranks (held ids, counting mask or None, written
    mask or None), each rank's totals all-reduced with the other's."""
    local = []
    for ids, counting, keep in layouts:
        sums = TwoRankSums(counting)
        first_token_metrics(sums, held_of(ids), *buffers(ids, keep)[:2])
        local.append(sums.local)
    return [
        first_token_metrics(TwoRankSums(counting, other), held_of(ids), *buffers(ids, keep)[:2])
        for (ids, counting, keep), other in zip(layouts, reversed(local), strict=True)
    ]


def test_first_token_means_on_one_rank():
    ids = [0, 1, 2, 3]
    r, v, r_first, v_first = buffers(ids)
    got = first_token_metrics(TokenSums(None, None), held_of(ids), r, v)
    assert got["critic/value_first_token"] == pytest.approx(v_first.double().mean().item())
    assert got["critic/return_first_token"] == pytest.approx(r_first.double().mean().item())
    # Not the means over all tokens.
    assert got["critic/value_first_token"] != pytest.approx(v.double().mean().item())


def test_first_token_means_are_the_same_for_any_layout():
    _, _, r_first, v_first = buffers([0, 1, 2, 3])
    expected = {
        "critic/value_first_token": v_first.double().mean().item(),
        "critic/return_first_token": r_first.double().mean().item(),
    }
    # Data parallel: each rank holds and counts its own samples.
    dp = two_ranks([([0, 2], None, None), ([1, 3], None, None)])
    # Context parallel: both hold every sample; each wrote (and counts) its half of each
    # sequence's tokens, zeros elsewhere; sample 1's only token is rank 1's.
    first_half = torch.tensor([1, 1, 0, 0, 1, 1, 0, 0, 1, 0], dtype=torch.bool)
    halves = [first_half, ~first_half]
    cp = two_ranks([([0, 1, 2, 3], m, m.float()) for m in halves])
    # Tensor parallel: both hold everything, only rank 0 counts.
    none = torch.zeros(sum(LENGTHS), dtype=torch.bool)
    tp = two_ranks([([0, 1, 2, 3], None, None), ([0, 1, 2, 3], none, None)])
    for got in [*dp, *cp, *tp]:
        assert got == pytest.approx(expected)


def test_profile_reads_the_quarter_and_last_tokens():
    ids = [0, 1, 2, 3]
    r, v, _, _ = buffers(ids)
    offsets = torch.tensor([0, *LENGTHS]).cumsum(0).tolist()
    got = profile_metrics(TokenSums(None, None), held_of(ids), torch.tensor(LENGTHS), r, v)
    for name, fraction in PROFILE_POINTS.items():
        at = [offsets[i] + round(fraction * (n - 1)) for i, n in enumerate(LENGTHS)]
        assert got[f"critic/value_{name}"] == pytest.approx(v[at].double().mean().item())
        assert got[f"critic/return_{name}"] == pytest.approx(r[at].double().mean().item())
    # Lengths 3, 1, 4, 2: the last token is position 2, 0, 3, 1 of each response.
    assert got["critic/value_last"] == pytest.approx(v[[2, 3, 7, 9]].double().mean().item())


def test_profile_is_the_same_on_two_data_parallel_ranks():
    lengths = torch.tensor(LENGTHS)
    r, v, _, _ = buffers([0, 1, 2, 3])
    expected = profile_metrics(TokenSums(None, None), held_of([0, 1, 2, 3]), lengths, r, v)
    local = []
    for ids in ([0, 2], [1, 3]):
        sums = TwoRankSums(None)
        profile_metrics(sums, held_of(ids), lengths, *buffers(ids)[:2])
        local.append(sums.local)
    for ids, other in zip(([0, 2], [1, 3]), reversed(local), strict=True):
        got = profile_metrics(TwoRankSums(None, other), held_of(ids), lengths, *buffers(ids)[:2])
        assert got == pytest.approx(expected)


def test_positive_share_of_failing_tokens():
    ids = [0, 1, 2, 3]
    rewards = torch.tensor([-1.0, 1.0, -1.0, 0.0])  # samples 0, 2, 3 fail (reward <= 0)
    advantages = torch.tensor([0.5, -0.1, 0.0, 2.0, 0.3, 0.3, -1.0, -2.0, 0.1, -0.1])
    got = failing_advantage_metrics(
        TokenSums(None, None), held_of(ids), torch.tensor(LENGTHS), advantages, rewards
    )
    # Failing tokens: 0-2 (0.5, -0.1, 0.0), 4-7 (0.3, 0.3, -1, -2), 8-9 (0.1, -0.1): 4 of 9 > 0.
    assert got["advantages/positive_share_failing"] == pytest.approx(4 / 9)
    assert got["advantages/positive_share_passing"] == pytest.approx(1.0)
    # A rank that counts none of its tokens adds nothing (tensor-parallel peers).
    none = torch.zeros(sum(LENGTHS), dtype=torch.bool)
    sums = TwoRankSums(none)
    failing_advantage_metrics(sums, held_of(ids), torch.tensor(LENGTHS), advantages, rewards)
    assert sums.local.tolist() == [0.0, 0.0, 0.0, 0.0]
