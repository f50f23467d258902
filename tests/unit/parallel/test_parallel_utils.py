import pytest
import torch

from vapo_megatron.algorithms.gae import gae_padded
from vapo_megatron.parallel.context_parallel import merge_from_cp, split_for_cp, split_packed_for_cp
from vapo_megatron.parallel.cp_gae import gae_context_parallel
from vapo_megatron.parallel.reductions import global_loss_normalisers, sum_metrics

pytestmark = pytest.mark.unit


def test_split_layout_and_merge():
    x = torch.arange(16).view(1, 16)
    # CP=2: 4 chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert split_for_cp(x, 2, 0).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert split_for_cp(x, 2, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    for cp in (1, 2, 4, 8):
        assert torch.equal(merge_from_cp([split_for_cp(x, cp, r) for r in range(cp)]), x)
    with pytest.raises(ValueError, match="divide by 2 \\* cp_size"):
        split_for_cp(torch.zeros(1, 6), 2, 0)


def test_split_packed():
    x = torch.arange(12)
    cu = torch.tensor([0, 4, 12])
    assert split_packed_for_cp(x, cu, 2, 1).tolist() == [1, 2, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="padded sequence length"):
        split_packed_for_cp(x, torch.tensor([0, 3, 12]), 2, 0)


def test_cp_gae_without_group_is_plain_gae():
    gen = torch.Generator().manual_seed(0)
    r, v = torch.randn(3, 20, generator=gen), torch.randn(3, 20, generator=gen)
    mask = torch.rand(3, 20, generator=gen) > 0.3
    r = r * mask  # rewards sit on response tokens only (GAE rejects others)
    adv, ret = gae_context_parallel(r, v, mask, 0.9, 1.0, None)
    ref_adv, ref_ret = gae_padded(r, v, mask, 0.9, 1.0)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)


def test_normalisers_single_process():
    masks = [torch.tensor([[1, 1, 0]]), torch.tensor([[0, 1, 1], [1, 0, 0]])]
    positive = [torch.tensor([[1, 1, 1]]), torch.tensor([[0, 0, 0], [1, 1, 1]])]
    norm = global_loss_normalisers(
        masks, positive, 3, dp_cp_group=None, cp_size=1, device=torch.device("cpu")
    )
    assert (norm.num_tokens.item(), norm.num_seqs.item(), norm.num_positive_tokens.item()) == (
        5,
        3,
        3,
    )
    with pytest.raises(ValueError, match="positive masks"):
        global_loss_normalisers(
            masks, positive[:1], 3, dp_cp_group=None, cp_size=1, device=torch.device("cpu")
        )
    assert sum_metrics({"a": torch.tensor(0.25), "b": torch.tensor(1.0)}, None) == {
        "a": 0.25,
        "b": 1.0,
    }
