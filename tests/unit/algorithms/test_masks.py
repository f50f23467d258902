"""algorithms/masks.py: the same answers as torch's sum, all and any, on every kind of mask."""

import pytest
import torch

from vapo_megatron.algorithms.masks import all_true, any_true, count_true

MASKS = {
    "empty": torch.zeros(0, dtype=torch.bool),
    "all true": torch.ones(7, dtype=torch.bool),
    "all false": torch.zeros(7, dtype=torch.bool),
    "mixed 2-D": torch.tensor([[True, False, True], [False, False, True]]),
    "expanded true": torch.ones(1, dtype=torch.bool).expand(1000),
    "expanded false": torch.zeros(1, dtype=torch.bool).expand(1000),
    "strided": torch.arange(20).remainder(3).eq(0)[::2],
    "int32 0/1": torch.tensor([0, 1, 1, 0, 2], dtype=torch.int32),
    "float": torch.tensor([0.0, 0.5, -1.0]),
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_answers_match_torch(name):
    mask = MASKS[name]
    assert count_true(mask) == int((mask != 0).sum())
    assert all_true(mask) == bool(mask.bool().all())
    assert any_true(mask) == bool(mask.bool().any())
    assert isinstance(count_true(mask), int)
