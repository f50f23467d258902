"""ContextParallelDotProductAttention in one process: dense causal, GQA, packed THD, padding."""

import math

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from vapo_megatron.models.attention import ContextParallelDotProductAttention
from vapo_megatron.models.layer_spec import local_layer_spec

pytestmark = pytest.mark.unit

HEADS, HEAD_DIM = 4, 8


def attention(groups: int, mask_type=AttnMaskType.causal) -> ContextParallelDotProductAttention:
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_query_groups=groups,
        attention_dropout=0.0,
    )
    single = ProcessGroupCollection()
    single.tp, single.cp = None, None  # this process alone
    return ContextParallelDotProductAttention(
        config,
        layer_number=1,
        attn_mask_type=mask_type,
        attention_type="self",
        pg_collection=single,
    )


def reference(q, k, v, causal=True, mask=None):
    """Plain softmax attention. q [s, b, np, hn], k/v [s, b, ng, hn] -> [s, b, np * hn]."""
    rep = q.size(2) // k.size(2)
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(q.size(-1))
    if causal:
        s = q.size(0)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    out = torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v)
    return out.reshape(q.size(0), q.size(1), -1)


def qkv(seq, batch, groups, gen, leading=None):
    shape = (seq, batch) if leading is None else leading
    return [
        torch.randn(*shape, h, HEAD_DIM, generator=gen, dtype=torch.float64, requires_grad=True)
        for h in (HEADS, groups, groups)
    ]


@pytest.mark.parametrize("groups", [4, 2, 1])
def test_dense_causal_matches_reference_with_grads(groups):
    gen = torch.Generator().manual_seed(0)
    q, k, v = qkv(10, 3, groups, gen)
    out = attention(groups)(q, k, v, None)
    want = reference(q, k, v)
    assert out.shape == (10, 3, HEADS * HEAD_DIM)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)
    weight = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad((out * weight).sum(), (q, k, v))
    ref = torch.autograd.grad((want * weight).sum(), (q, k, v))
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=1e-12)


def test_explicit_mask_replaces_causality_like_the_stock_module():
    gen = torch.Generator().manual_seed(1)
    q, k, v = qkv(6, 2, 2, gen)
    mask = torch.rand(2, 1, 6, 6, generator=gen) > 0.6  # True = masked
    mask[..., 0] = False  # every query sees at least one key
    out = attention(2, AttnMaskType.padding)(q, k, v, mask)
    torch.testing.assert_close(out, reference(q, k, v, causal=False, mask=mask))
    bidirectional = attention(2, AttnMaskType.no_mask)(q, k, v, None)
    torch.testing.assert_close(bidirectional, reference(q, k, v, causal=False))


def packed_batch():
    """Three sequences (real lengths 5, 0, 7) padded to 8, 0, 8, in THD layout."""
    real, padded = [5, 0, 7], [8, 0, 8]
    cu = torch.tensor([0, *torch.tensor(real).cumsum(0).tolist()], dtype=torch.int32)
    cu_padded = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=8,
        max_seqlen_kv=8,
    )
    return real, padded, params


def test_packed_equals_each_sequence_alone_and_ignores_padding():
    gen = torch.Generator().manual_seed(2)
    real, padded, params = packed_batch()
    q, k, v = qkv(None, None, 2, gen, leading=(sum(padded),))  # [t, h, d]
    module = attention(2)
    out = module(q, k, v, None, packed_seq_params=params)
    assert out.shape == (sum(padded), HEADS * HEAD_DIM)

    start, pieces = 0, []
    for n_real, n_padded in zip(real, padded, strict=True):
        sl = slice(start, start + n_real)
        alone = module(q[sl, None], k[sl, None], v[sl, None], None)  # [s, 1, h * d]
        pieces.append(alone[:, 0])
        if n_real:
            torch.testing.assert_close(
                alone[:, 0], reference(*(x[sl, None] for x in (q, k, v)))[:, 0]
            )
        assert torch.all(out[start + n_real : start + n_padded] == 0), "padding output not zero"
        start += n_padded
    real_rows = torch.cat([torch.arange(a, a + r) for a, r in zip([0, 8, 8], real, strict=True)])
    torch.testing.assert_close(out[real_rows], torch.cat(pieces), atol=1e-12, rtol=1e-12)

    # Changing padding keys/values changes no real output and gets no gradient.
    pad_rows = torch.tensor([5, 6, 7, 15])
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[pad_rows] += 100.0
    v2[pad_rows] -= 100.0
    out2 = module(q, k2, v2, None, packed_seq_params=params)
    torch.testing.assert_close(out2, out, atol=1e-12, rtol=1e-12)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    for g in grads:
        assert torch.all(g[pad_rows] == 0)


def test_packed_without_padding_takes_odd_lengths():
    gen = torch.Generator().manual_seed(4)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7
    )
    q, k, v = qkv(None, None, 2, gen, leading=(10,))
    out = attention(2)(q, k, v, None, packed_seq_params=params)
    for sl in (slice(0, 3), slice(3, 10)):
        torch.testing.assert_close(out[sl], reference(*(x[sl, None] for x in (q, k, v)))[:, 0])


def test_packed_rejects_a_rope_table_as_long_as_the_packing():
    gen = torch.Generator().manual_seed(3)
    _, padded, params = packed_batch()
    params.max_seqlen_q = params.max_seqlen_kv = sum(padded)
    q, k, v = qkv(None, None, 2, gen, leading=(sum(padded),))
    with pytest.raises(ValueError, match="RoPE restarts"):
        attention(2)(q, k, v, None, packed_seq_params=params)
    params.max_seqlen_q = params.max_seqlen_kv = 8
    with pytest.raises(ValueError, match="holds 15 tokens"):
        attention(2)(q[:15], k[:15], v[:15], None, packed_seq_params=params)


def test_layer_spec_uses_this_attention():
    spec = local_layer_spec()
    core = spec.submodules.self_attention.submodules.core_attention
    assert core is ContextParallelDotProductAttention
