"""The step whitens its advantages in place (``advantages.whiten_``): the same float32
operations as ``(x - mean) / (std + eps)``, so the same bits, with no second buffer."""

import pytest
import torch

from vapo_megatron.step.advantages import whiten, whiten_
from vapo_megatron.step.token_sums import TokenSums

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("counted", [False, True])
def test_whiten_in_place_is_bit_identical(counted):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(300_001, generator=generator) * 7.3 + 2.1
    mask = torch.rand(x.numel(), generator=generator) > 0.3 if counted else None
    sums = TokenSums(mask, None)
    mean, std = sums.mean_std(x)
    expected = (x - mean) / (std + 1e-8)
    kept = x.clone()
    assert torch.equal(whiten(x, sums), expected)
    assert torch.equal(x, kept)  # whiten leaves its input alone
    out = whiten_(x, sums)
    assert out is x
    assert torch.equal(x, expected)
