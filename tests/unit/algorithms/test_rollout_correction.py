"""Rollout importance correction (TIS, MIS/IcePop) against hand-computed weights."""

import math

import pytest
import torch

from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.algorithms.rollout_correction import (
    RolloutCorrectionConfig,
    correction_metrics,
    rollout_weights,
)

pytestmark = pytest.mark.unit

# Two sequences: 3 tokens with ratios 0.4, 1.0, 3.0; 2 tokens with ratios 1.5, 1.2.
RATIOS = [0.4, 1.0, 3.0, 1.5, 1.2]
OFFSETS = torch.tensor([0, 3, 5])


def _logprobs():
    rollout = torch.tensor([-1.0, -2.0, -0.5, -3.0, -0.1])
    old = rollout + torch.tensor(RATIOS).log()
    return old, rollout


def _weights(**kwargs):
    old, rollout = _logprobs()
    return rollout_weights(old, rollout, OFFSETS, RolloutCorrectionConfig(**kwargs))


def test_off_is_ones():
    weight, keep = _weights()
    assert weight.tolist() == [1.0] * 5 and keep.all()
    assert not RolloutCorrectionConfig().enabled and not AlgoConfig().rollout_correction.enabled


def test_token_tis_truncates_each_ratio():
    weight, keep = _weights(truncate="token", truncate_at=2.0)
    assert weight.tolist() == pytest.approx([0.4, 1.0, 2.0, 1.5, 1.2], rel=1e-6)
    assert keep.all()


def test_sequence_tis_truncates_the_product():
    weight, _ = _weights(truncate="sequence", truncate_at=2.0)
    first = min(0.4 * 1.0 * 3.0, 2.0)  # 1.2
    second = min(1.5 * 1.2, 2.0)  # 1.8
    assert weight.tolist() == pytest.approx([first] * 3 + [second] * 2, rel=1e-6)


def test_token_mask_zeroes_outside_bounds():
    weight, keep = _weights(mask="token", mask_low=0.5, mask_high=2.0)
    assert keep.tolist() == [False, True, False, True, True]
    assert weight.tolist() == pytest.approx([0.0, 1.0, 0.0, 1.0, 1.0])


def test_sequence_mask_uses_the_geometric_mean():
    # geometric means: (0.4 * 1 * 3)^(1/3) = 1.0627 (kept), (1.5 * 1.2)^(1/2) = 1.342 (kept
    # at high 2, dropped at high 1.3).
    assert math.isclose((0.4 * 3.0) ** (1 / 3), 1.0627, rel_tol=1e-4)
    _, keep = _weights(mask="sequence", mask_low=0.5, mask_high=2.0)
    assert keep.all()
    weight, keep = _weights(mask="sequence", mask_low=0.5, mask_high=1.3)
    assert keep.tolist() == [True, True, True, False, False]
    assert weight.tolist() == pytest.approx([1.0, 1.0, 1.0, 0.0, 0.0])


def test_truncate_and_mask_combine():
    weight, _ = _weights(truncate="token", truncate_at=1.4, mask="token")
    assert weight.tolist() == pytest.approx([0.0, 1.0, 0.0, 1.4, 1.2], rel=1e-6)


def test_metrics_are_shares_of_the_global_token_mean():
    weight, keep = _weights(truncate="token", truncate_at=1.4, mask="token")
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])  # the last token does not count
    m = correction_metrics(weight, keep, mask, num_tokens=8)
    assert m["rollout_is_weight"].item() == pytest.approx((0 + 1 + 0 + 1.4) / 8, rel=1e-6)
    assert m["rollout_masked_frac"].item() == pytest.approx(2 / 8)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"truncate": "sample"},
        {"mask": "tokens"},
        {"truncate_at": 0.0},
        {"mask_low": 1.2},
        {"mask_high": 0.9},
    ],
)
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="rollout_correction"):
        RolloutCorrectionConfig(**kwargs)


def test_bad_shapes_are_refused():
    old, rollout = _logprobs()
    with pytest.raises(ValueError, match="one shape"):
        rollout_weights(old, rollout[:4], OFFSETS, RolloutCorrectionConfig(truncate="token"))
    with pytest.raises(ValueError, match="offsets end at"):
        rollout_weights(old, rollout, torch.tensor([0, 3]), RolloutCorrectionConfig())
