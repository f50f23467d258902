"""``routed_route._fill_spans``: how a rank lays the advantages it was sent (pieces of whole
samples, end to end) into the spans of its policy buffer, and the error where a sender and
this rank disagree on how many it is owed."""

from __future__ import annotations

import pytest
import torch

from vapo_megatron.step.routed_route import _fill_spans

pytestmark = pytest.mark.unit


def test_chunks_fill_spans_across_their_boundaries():
    out = torch.full((10,), -1.0, device="cpu")
    chunks = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0]), torch.tensor([5.0, 6.0])]
    _fill_spans(out, [(0, 2), (4, 7), (9, 10)], chunks, 0)
    assert out.tolist() == [1, 2, -1, -1, 3, 4, 5, -1, -1, 6]


def test_nothing_owed_and_nothing_sent_is_fine():
    out = torch.zeros(3, device="cpu")
    _fill_spans(out, [], [torch.zeros(0, device="cpu")], 0)
    assert out.tolist() == [0, 0, 0]


@pytest.mark.parametrize("sent", [2, 4])
def test_a_piece_of_the_wrong_length_is_refused(sent):
    out = torch.zeros(5, device="cpu")
    with pytest.raises(RuntimeError, match=f"rank 1 was sent {sent} advantages .* owes it 3"):
        _fill_spans(out, [(0, 1), (3, 5)], [torch.ones(sent, device="cpu")], 1)
