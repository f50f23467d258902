"""``scoring_pass._write``: a micro-batch's outputs on its response tokens into the step's
buffer, by its response runs where it has them (no CP) and by its mask otherwise: both give
the masked select's elements, and a span that does not fit the micro-batch is refused."""

import pytest
import torch

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.data.packing import Sample, pack_many
from vapo_megatron.step.batching import empty_micro_batch
from vapo_megatron.step.scoring_pass import _write

pytestmark = pytest.mark.unit


def chunk_and_outputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    groups = []
    for _ in range(4):
        group = []
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            p, r = (int(x) for x in torch.randint(1, 9, (2,), generator=g))
            r = r if seed % 2 else r - 1  # empty responses too
            group.append(Sample(list(range(1, p + 1)), list(range(1, r + 1))))
        groups.append(group)
    chunk = pack_many(groups, pad_multiple=3)
    outputs = [torch.randn(mb.tokens.shape, generator=g).to(torch.bfloat16) for mb in chunk]
    return chunk, outputs


@pytest.mark.parametrize("seed", range(4))
def test_runs_and_mask_write_the_same_tokens(seed):
    chunk, outputs = chunk_and_outputs(seed)
    counts = [int(mb.response_mask.sum()) for mb in chunk]
    bounds = torch.tensor([0, *counts]).cumsum(0).tolist()
    spans = [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    want = torch.cat(
        [
            o.reshape(-1)[mb.response_mask.reshape(-1)].float()
            for mb, o in zip(chunk, outputs, strict=True)
        ]
    )
    by_runs = torch.full((bounds[-1],), float("nan"))
    held = torch.zeros(bounds[-1], dtype=torch.bool)
    _write(by_runs, held, chunk, outputs, spans)
    assert torch.equal(by_runs, want) and bool(held.all())
    for mb in chunk:  # the mask's path (as under CP)
        mb.response_runs = None
    by_mask = torch.full((bounds[-1],), float("nan"))
    _write(by_mask, None, chunk, outputs, spans)
    assert torch.equal(by_mask, want)


def test_a_span_of_another_size_is_refused():
    chunk, outputs = chunk_and_outputs(1)
    n = int(chunk[0].response_mask.sum())
    with pytest.raises(RuntimeError, match=f"{n} response tokens for a span of {n + 1}"):
        _write(torch.zeros(n + 1), None, chunk[:1], outputs[:1], [slice(0, n + 1)])


def test_an_empty_micro_batch_writes_nothing():
    mb = empty_micro_batch(ModelLayout(), cp_rank=0, field_names=[])
    assert mb.response_runs == []
    buffer = torch.zeros(3)
    _write(buffer, None, [mb], [torch.ones(mb.tokens.shape)], [slice(0, 0)])
    assert not buffer.any()
