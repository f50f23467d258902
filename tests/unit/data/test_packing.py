import pytest
import torch

from vapo_megatron.data.packing import Sample, pack, packed_positions, pad
from vapo_megatron.parallel.context_parallel import merge_from_cp

pytestmark = pytest.mark.unit


def samples():
    return [
        Sample([1, 2, 3], [4, 5], {"adv": torch.tensor([0.5, 0.6])}),
        Sample([7], [8, 9, 10], {"adv": torch.tensor([1.0, 2.0, 3.0])}),
    ]


def test_label_aligned_padded():
    mb = pad(samples())
    assert mb.tokens.tolist() == [[1, 2, 3, 4, 5], [7, 8, 9, 10, 0]]
    assert mb.labels.tolist() == [[2, 3, 4, 5, 0], [8, 9, 10, 0, 0]]
    # The state before response token t is read at the token before it.
    assert mb.response_mask.int().tolist() == [[0, 0, 1, 1, 0], [1, 1, 1, 0, 0]]
    assert mb.fields["adv"][0, 2:4].tolist() == pytest.approx([0.5, 0.6])
    assert mb.labels[mb.response_mask].tolist() == [4, 5, 8, 9, 10]
    assert (mb.seq_length, mb.num_seqs) == (5, 2)


def test_packed_layout_and_cp_split():
    mb = pack(samples())
    assert mb.tokens.tolist() == [[1, 2, 3, 4, 5, 7, 8, 9, 10]]
    assert mb.position_ids is None  # a RoPE model restarts them from packed_seq_params
    assert packed_positions(mb).tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert mb.packed_seq_params.cu_seqlens_q.tolist() == [0, 5, 9]
    assert mb.packed_seq_params.cu_seqlens_q_padded.tolist() == [0, 5, 9]
    assert mb.labels[mb.response_mask].tolist() == [4, 5, 8, 9, 10]
    # CP=2: each sequence padded to a multiple of 4, rank r keeps chunks r and 3 - r.
    shards = [pack(samples(), cp_size=2, cp_rank=r) for r in range(2)]
    assert shards[0].packed_seq_params.cu_seqlens_q_padded.tolist() == [0, 8, 12]
    full = pack(samples(), cp_size=1, pad_multiple=1)
    assert full.labels[full.response_mask].tolist() == [4, 5, 8, 9, 10]
    assert sum(int(s.response_mask.sum()) for s in shards) == 5
    padded = [pad(samples(), cp_size=2, cp_rank=r) for r in range(2)]
    assert torch.equal(
        merge_from_cp([p.tokens for p in padded]), pad(samples(), pad_multiple=4).tokens
    )


def test_pad_multiple_gives_one_shape():
    short = [Sample([1], [2])]
    assert pad(short, pad_multiple=16).seq_length == 16
    assert pack(short + short, pad_multiple=16).seq_length == 16


def test_bad_samples():
    with pytest.raises(ValueError, match="at least one sample"):
        pack([])
    with pytest.raises(ValueError, match="prompt token"):
        pad([Sample([], [1])])
    with pytest.raises(ValueError, match="one value per response token"):
        pad([Sample([1], [2, 3], {"adv": torch.zeros(3)})])
    with pytest.raises(ValueError, match="fields"):
        pad([Sample([1], [2], {"adv": torch.zeros(1)}), Sample([1], [2])])


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("pad_multiple,pad_each", [(1, False), (3, False), (3, True)])
def test_pack_equals_each_sample_laid_out_alone(cp_size, pad_multiple, pad_each):
    """Each sequence of a packed row holds exactly what ``pad`` gives that sample alone, at its
    cu_seqlens_padded start (token ids given as lists and as int32 views); padding is zero."""
    from vapo_megatron.parallel.context_parallel import split_packed_for_cp

    gen = torch.Generator().manual_seed(cp_size * 10 + pad_multiple)
    batch = []
    for k in range(5):
        n_prompt, n_resp = int(torch.randint(1, 9, (1,), generator=gen)), k % 4
        prompt = torch.randint(1, 50, (n_prompt,), generator=gen, dtype=torch.int32)
        response = torch.randint(1, 50, (n_resp,), generator=gen).tolist()
        adv = torch.randn(n_resp, generator=gen)
        batch.append(Sample(prompt if k % 2 else prompt.tolist(), response, {"adv": adv}))
    for rank in range(cp_size):
        mb = pack(
            batch, cp_size=cp_size, cp_rank=rank, pad_multiple=pad_multiple, pad_each=pad_each
        )
        cu = mb.packed_seq_params.cu_seqlens_q_padded.long()
        assert (
            int(cu[-1]) == mb.seq_length
            and mb.seq_length % (pad_multiple * max(1, 2 * cp_size if cp_size > 1 else 1)) == 0
        )
        if pad_each:  # no sequence is lengthened for the row
            unit = pad_multiple * (2 * cp_size if cp_size > 1 else 1)
            lengths = [len(s.prompt) + len(s.response) for s in batch]
            assert cu.diff().tolist() == [-(-n // unit) * unit for n in lengths]
        full = {
            name: torch.zeros(mb.seq_length, dtype=dtype)
            for name, dtype in (
                ("tokens", torch.long), ("labels", torch.long), ("position_ids", torch.long),
                ("response_mask", torch.bool), ("adv", torch.float32),
            )
        }  # fmt: skip
        for i, sample in enumerate(batch):
            alone = pad([sample])
            n = alone.seq_length
            for name in full:
                value = alone.fields["adv"] if name == "adv" else getattr(alone, name)
                full[name][int(cu[i]) : int(cu[i]) + n] = value[0]
        for name, row in full.items():
            if name == "adv":
                got = mb.fields["adv"]
            elif name == "position_ids":
                got = packed_positions(mb, cp_size, rank)
            else:
                got = getattr(mb, name)
            want = split_packed_for_cp(row, cu, cp_size, rank) if cp_size > 1 else row
            assert torch.equal(got[0], want), (name, rank)
