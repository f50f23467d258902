"""How a rank lays the advantages it was sent into its policy buffer: ``_fill_spans`` (pieces
of whole samples, end to end, into spans) and ``AdvantageExchange.send`` from CP chunks (values
to positions), each with the error where a sender and this rank disagree on how many it is
owed (never a silent broadcast of one value)."""

from __future__ import annotations

import pytest
import torch

from vapo_megatron.step.advantage_exchange import _fill_spans

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


@pytest.fixture
def one_rank():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield


def positions_exchange(src: list[int], dst: list[int], num_tokens: int):
    """An exchange from CP chunks as ``AdvantageExchange.__init__`` leaves it on one rank:
    this rank's own tokens at ``src`` of its critic buffer go to ``dst`` of its policy
    buffer."""
    from vapo_megatron.step.advantage_exchange import AdvantageExchange

    exchange = AdvantageExchange.__new__(AdvantageExchange)
    exchange.host_group, exchange.num_tokens, exchange.whole = None, num_tokens, False
    exchange.src = [torch.tensor(src, dtype=torch.long, device="cpu")]
    exchange.dst = torch.tensor(dst, dtype=torch.long, device="cpu")
    exchange.dst_sizes = [len(dst)]
    return exchange


def test_positions_place_each_value(one_rank):
    exchange = positions_exchange([2, 0], [1, 3], num_tokens=4)
    out = exchange.send(torch.tensor([10.0, 11.0, 12.0], device="cpu"))
    assert out.tolist() == [0, 12, 0, 10]


def test_positions_never_broadcast_one_value_over_many(one_rank):
    exchange = positions_exchange([2], [1, 3], num_tokens=4)
    with pytest.raises(
        RuntimeError, match="rank 0 was sent 1 advantages by host rank 0, which owes it 2"
    ):
        exchange.send(torch.tensor([10.0, 11.0, 12.0], device="cpu"))
