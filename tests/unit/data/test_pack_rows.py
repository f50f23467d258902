"""``pack`` writes each row straight into an uninitialised buffer (only the padding zeroed):
every position of every row must still equal a plain per-token reference, for lists and int32
views, fields of several dtypes, empty responses, padding under CP and ``pad_each``."""

import random

import pytest
import torch

from vapo_megatron.data.packing import IDS, Sample, pack, pack_many, packed_positions
from vapo_megatron.parallel.context_parallel import split_packed_for_cp

pytestmark = pytest.mark.unit


def reference_rows(samples, cp_size, pad_multiple, pad_each):
    """(tokens, positions, labels, mask, fields, cu_padded) built token by token."""
    cp_multiple = 2 * cp_size if cp_size > 1 else 1
    lengths = [len(s.prompt) + len(s.response) for s in samples]
    unit = cp_multiple * (pad_multiple if pad_each else 1)
    widths = [-(-n // unit) * unit for n in lengths]
    row_unit = cp_multiple * pad_multiple
    widths[-1] += -(-sum(widths) // row_unit) * row_unit - sum(widths)
    tokens, positions, labels, mask = [], [], [], []
    fields = {name: [] for name in samples[0].fields}
    for s, n, width in zip(samples, lengths, widths, strict=True):
        ids = [int(t) for t in s.prompt] + [int(t) for t in s.response]
        p, r, gap = len(s.prompt), len(s.response), width - n
        tokens += ids + [0] * gap
        positions += list(range(n)) + [0] * gap
        labels += ids[1:] + [0] * (gap + 1)
        mask += [False] * (p - 1) + [True] * r + [False] * (gap + 1)
        for name, values in s.fields.items():
            fields[name] += [0] * (p - 1) + values.tolist() + [0] * (gap + 1)
    cu_padded = torch.tensor([0, *torch.tensor(widths).cumsum(0).tolist()], dtype=torch.int32)
    return tokens, positions, labels, mask, fields, cu_padded


def cp_row(values, dtype, cu_padded, cp, rank) -> torch.Tensor:
    """[1, t] this CP rank's part of a reference row."""
    x = torch.tensor(values, dtype=dtype)
    return (split_packed_for_cp(x, cu_padded, cp, rank) if cp > 1 else x)[None]


def random_samples(rng: random.Random) -> list[Sample]:
    dtype = rng.choice([torch.float32, torch.float64, torch.bool, torch.long])
    with_fields = rng.random() < 0.7
    out = []
    for _ in range(rng.randint(1, 5)):
        prompt = [rng.randint(1, 99) for _ in range(rng.randint(1, 9))]
        response = [rng.randint(1, 99) for _ in range(rng.randint(0, 12))]
        if rng.random() < 0.5:  # views of the step's int32 buffers, as the step passes them
            prompt = torch.tensor([0, *prompt], dtype=torch.int32)[1:]
            response = torch.tensor(response, dtype=torch.int32)
        n = len(response)
        fields = {"a": (torch.randn(n) * 5).to(dtype), "b": torch.randn(n)} if with_fields else {}
        out.append(Sample(prompt, response, fields))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_pack_equals_token_by_token_reference(seed):
    rng = random.Random(seed)
    for _ in range(150):
        samples = random_samples(rng)
        cp, multiple, each = rng.choice([1, 2, 4]), rng.choice([1, 2, 3]), rng.random() < 0.5
        tokens, positions, labels, mask, fields, cu_padded = reference_rows(
            samples, cp, multiple, each
        )
        for rank in range(cp):
            mb = pack(samples, cp_size=cp, cp_rank=rank, pad_multiple=multiple, pad_each=each)
            assert torch.equal(mb.packed_seq_params.cu_seqlens_q_padded, cu_padded)
            shard = (cu_padded, cp, rank)
            assert mb.tokens.dtype == mb.labels.dtype == IDS  # widened on the device only
            assert torch.equal(mb.tokens, cp_row(tokens, IDS, *shard))
            assert mb.position_ids is None
            assert torch.equal(
                packed_positions(mb, cp, rank), cp_row(positions, torch.long, *shard)
            )
            assert torch.equal(mb.labels, cp_row(labels, IDS, *shard))
            assert torch.equal(mb.response_mask, cp_row(mask, torch.bool, *shard))
            assert_runs_match_mask(mb, cp)
            for name, values in fields.items():
                dtype = samples[0].fields[name].dtype
                assert mb.fields[name].dtype == dtype
                assert torch.equal(mb.fields[name], cp_row(values, dtype, *shard))


def test_num_tokens_counts_lists_and_tensors():
    assert Sample([1, 2, 3], [4]).num_tokens == 4
    ids = torch.arange(10, dtype=torch.int32)
    assert Sample(ids[:3], ids[3:]).num_tokens == 10


def assert_runs_match_mask(mb, cp):
    """``response_runs`` mark exactly the mask's positions, in order (None under CP)."""
    if cp > 1:
        assert mb.response_runs is None
        return
    from_runs = torch.zeros(mb.seq_length, dtype=torch.bool)
    for start, n in mb.response_runs:
        assert not from_runs[start : start + n].any()
        from_runs[start : start + n] = True
    assert torch.equal(from_runs, mb.response_mask[0])
    assert [s for s, _ in mb.response_runs] == sorted(s for s, _ in mb.response_runs)
    assert len(mb.response_runs) == mb.num_seqs


def assert_same_micro_batch(got, want):
    assert got.seq_length == want.seq_length and got.num_seqs == want.num_seqs
    assert got.position_ids is None and want.position_ids is None
    for name in ("tokens", "labels", "response_mask"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert got.fields.keys() == want.fields.keys()
    for name, value in want.fields.items():
        assert got.fields[name].dtype == value.dtype and torch.equal(got.fields[name], value)
    p, q = got.packed_seq_params, want.packed_seq_params
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert torch.equal(getattr(p, name), getattr(q, name)), name
    assert (p.max_seqlen_q, p.max_seqlen_kv) == (q.max_seqlen_q, q.max_seqlen_kv)
    assert p.qkv_format == q.qkv_format
    assert got.response_runs == want.response_runs


@pytest.mark.parametrize("seed", range(3))
def test_pack_many_equals_pack_one_at_a_time(seed):
    """Many micro-batches written as one chunk: each equals ``pack`` of its group (and so the
    token-by-token reference above), under CP, ``pad_each`` and fields of several dtypes."""
    rng = random.Random(100 + seed)
    for _ in range(60):
        with_fields = rng.random() < 0.7
        groups = []
        for _ in range(rng.randint(1, 6)):
            group = random_samples(rng)
            if not with_fields:
                group = [Sample(s.prompt, s.response) for s in group]
            else:  # one field set for the whole chunk, as a pass packs
                group = [
                    Sample(s.prompt, s.response, {"b": torch.randn(len(s.response))}) for s in group
                ]
            groups.append(group)
        cp, multiple, each = rng.choice([1, 2, 4]), rng.choice([1, 2, 3]), rng.random() < 0.5
        for rank in range(cp):
            kwargs = dict(cp_size=cp, cp_rank=rank, pad_multiple=multiple, pad_each=each)
            got = pack_many(groups, **kwargs)
            assert len(got) == len(groups)
            for mb, group in zip(got, groups, strict=True):
                assert_same_micro_batch(mb, pack(group, **kwargs))


def test_pack_many_with_mixed_field_dtypes_casts_as_pack_does():
    """A field whose dtype differs between samples is cast to each micro-batch's first
    sample's dtype, as ``pack`` does (a chunk-wide cat would promote instead)."""
    groups = [
        [Sample([1, 2], [3, 4], {"a": torch.tensor([1.5, 2.5], dtype=torch.float64)})],
        [
            Sample([5], [6, 7, 8], {"a": torch.tensor([0.1, 0.2, 0.3])}),
            Sample([9], [10], {"a": torch.tensor([7.0], dtype=torch.float64)}),
        ],
    ]
    got = pack_many(groups)
    assert [mb.fields["a"].dtype for mb in got] == [torch.float64, torch.float32]
    for mb, group in zip(got, groups, strict=True):
        assert_same_micro_batch(mb, pack(group))


def test_pack_many_refuses_an_empty_group_and_mixed_fields():
    with pytest.raises(ValueError, match="at least one sample"):
        pack_many([[Sample([1], [2])], []])
    with pytest.raises(ValueError, match="has fields"):
        pack_many([[Sample([1], [2], {"a": torch.zeros(1)})], [Sample([1], [2])]])
    assert pack_many([]) == []
