"""Core attention for megatron-core's local layer spec with context parallelism and packing.

Megatron-core 0.16.1's local ``DotProductAttention`` asserts ``context_parallel_size == 1``
and rejects ``PackedSeqParams``; only Transformer Engine's attention supports either, and TE
needs a GPU. ``ContextParallelDotProductAttention`` takes its place in the local spec (see
``layer_spec.local_layer_spec``) and computes the same softmax attention on CPU:

- Context parallelism: K and V are all-gathered over the CP group (the backward pass
  reduce-scatters their gradients back to the owning ranks), put back in sequence order, and
  each local query attends causally by its *global* position. Rank r holds chunks r and
  2 * CP - 1 - r of every sequence (``parallel.context_parallel``).
- Packed sequences (``qkv_format="thd"``): attention stays inside each sequence; tokens
  between ``cu_seqlens_q`` and ``cu_seqlens_q_padded`` are padding, attended to by nobody,
  and their own outputs are zero.

The scores are a dense [local tokens, all tokens] matrix per head: fine for CPU development
and tests, not a long-context kernel (on GPU, TE's attention is used instead).
"""

from __future__ import annotations

import functools
import math

import torch
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from vapo_megatron.parallel.devices import HOST

_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)


class ContextParallelDotProductAttention(MegatronModule):
    """Drop-in for megatron-core's ``DotProductAttention`` that supports CP > 1 and THD.

    Same constructor as ``megatron.core.transformer.dot_product_attention
    .DotProductAttention`` (``SelfAttention`` builds it from the layer spec).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ):
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError(
                f"ContextParallelDotProductAttention supports self attention only, got "
                f"attention_type={attention_type!r}"
            )
        if config.window_size is not None or config.softmax_type != "vanilla":
            raise ValueError(
                f"ContextParallelDotProductAttention supports full-window vanilla softmax only, "
                f"got window_size={config.window_size}, softmax_type={config.softmax_type!r}"
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        # K/V all-gather is the only CP scheme here; cp_comm_type picks among TE's schemes.
        self.cp_comm_type = cp_comm_type
        # SelfAttention passes the model's pg_collection (each model has its own: the policy's
        # and the critic's CP groups differ); constructed on its own, as the stock module
        # allows, this falls back to parallel_state's groups, Megatron's convention.
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.cp_group = pg_collection.cp
        # megatron's default sharded_state_dict reads it (else parallel_state's TP group).
        self.tp_group = pg_collection.tp
        # apply_query_key_layer_scaling divides the scale by layer_number and the fp16 softmax
        # multiplies it back; with the softmax in fp32 both cancel, so it is left out.
        # MLA passes its query/key width (nope + rope) and value width (``k_channels``,
        # ``v_channels``); the shapes come from the tensors, only the default scale needs one.
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(k_channels or config.kv_channels)
        self.softmax_scale = softmax_scale
        self.attention_dropout = torch.nn.Dropout(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        """Attention of this rank's queries over the whole sequence(s).

        query: [sq, b, np, hn], key/value: [sq, b, ng, hn] (THD: [t, np, hn], [t, ng, hn],
        this rank's tokens; under MLA value's width hv may differ from hn). attention_mask: None, or (CP = 1, not packed only) a bool mask
        broadcastable to [b, 1, sq, sk], True = masked, used instead of causality as in the
        stock module. Returns [sq, b, np * hv] (THD: [t, np * hv]).
        """
        if attention_bias is not None:
            raise ValueError("ContextParallelDotProductAttention does not take attention_bias")
        causal = (attn_mask_type or self.attn_mask_type) in _CAUSAL
        cp_size, cp_rank = _size_and_rank(self.cp_group)
        packed = packed_seq_params is not None
        if packed and packed_seq_params.qkv_format != "thd":
            raise ValueError(
                f"packed_seq_params.qkv_format must be 'thd', got {packed_seq_params.qkv_format!r}"
            )
        if attention_mask is not None and (packed or cp_size > 1):
            raise ValueError(
                "an explicit attention_mask is only supported at CP = 1 without packing; pass "
                "attention_mask=None (causality and packing come from attn_mask_type and "
                "packed_seq_params)"
            )
        if packed:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            bounds, real_lengths = _packed_bounds(packed_seq_params, query.size(0), cp_size)
        else:
            if cp_size > 1 and query.size(0) % 2 != 0:
                raise ValueError(
                    f"local sequence length {query.size(0)} must be even under CP: each rank "
                    f"holds two chunks (split the batch with split_for_cp)"
                )
            full_length = query.size(0) * cp_size
            bounds, real_lengths = (0, full_length), (full_length,)

        key_order, allowed = _attention_layout(
            bounds, real_lengths, cp_size, cp_rank, causal, query.device
        )
        if cp_size > 1:
            # Autograd-aware all-gather along dim 0 on any group; backward reduce-scatters.
            key, value = (
                tensor_parallel.gather_from_sequence_parallel_region(
                    x, tensor_parallel_output_grad=True, group=self.cp_group
                ).index_select(0, key_order)
                for x in (key, value)
            )
        if attention_mask is not None:
            allowed = ~attention_mask.bool()  # [b or 1, 1, sq, sk]
        else:
            allowed = allowed[None, None]  # [1, 1, sq, sk]

        if not packed:
            return self._attend(query, key, value, allowed)  # [sq, b, np * hn]
        # Packed: attention never crosses sequences, so attend block by block (sum of
        # length^2 work instead of (total length)^2). Rank-local rows of sequence i are
        # contiguous (its two chunks); its keys sit at [bounds[i], bounds[i + 1]).
        contexts = []
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            rows = slice(start // cp_size, end // cp_size)
            contexts.append(
                self._attend(
                    query[rows], key[start:end], value[start:end], allowed[..., rows, start:end]
                )
            )
        return torch.cat(contexts).squeeze(1)

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, allowed: Tensor) -> Tensor:
        """Masked softmax attention. query [sq, b, np, hn], key/value [sk, b, ng, hn],
        allowed: bool, broadcastable to [b, 1, sq, sk]. Returns [sq, b, np * hv], hv the
        value width (MLA: v_head_dim, not the query/key width hn)."""
        sq, batch, heads, head_dim = query.shape
        groups = key.size(2)
        # GQA by broadcasting: query head h uses key/value group h // (np / ng).
        q = query.reshape(sq, batch, groups, heads // groups, head_dim).permute(1, 2, 3, 0, 4)
        k = key.permute(1, 2, 3, 0).unsqueeze(2)  # [b, ng, 1, hn, sk]
        v = value.permute(1, 2, 0, 3).unsqueeze(2)  # [b, ng, 1, sk, hn]
        scores = torch.matmul(q, k)  # [b, ng, rep, sq, sk]
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * self.softmax_scale
        allowed = allowed.unsqueeze(1)  # [b, 1, 1, sq, sk]
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        # Queries that may attend to nothing (padding) get zero output rather than NaN.
        probs = torch.softmax(scores, dim=-1) * allowed.any(dim=-1, keepdim=True)
        if self.training and self.attention_dropout.p > 0:
            if self.config.sequence_parallel:
                probs = self.attention_dropout(probs)
            else:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    probs = self.attention_dropout(probs)
        context = torch.matmul(probs.to(v.dtype), v)  # [b, ng, rep, sq, hn]
        return context.permute(3, 0, 1, 2, 4).reshape(sq, batch, heads * value.size(-1))


def _size_and_rank(group: torch.distributed.ProcessGroup | None) -> tuple[int, int]:
    return (1, 0) if group is None else (group.size(), group.rank())


def _packed_bounds(
    params: PackedSeqParams, local_tokens: int, cp_size: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(padded sequence boundaries, real lengths) of a THD batch, checked against the layout."""
    cu_real = params.cu_seqlens_q
    cu_padded = cu_real if params.cu_seqlens_q_padded is None else params.cu_seqlens_q_padded
    # RoPE places keys by these boundaries: they must be the queries' (self attention).
    cu_kv = params.cu_seqlens_kv_padded
    cu_kv = params.cu_seqlens_kv if cu_kv is None else cu_kv
    if cu_kv is None or not torch.equal(cu_kv.cpu(), cu_padded.cpu()):
        raise ValueError(
            "set cu_seqlens_kv(_padded) equal to cu_seqlens_q(_padded) (self attention)"
        )
    bounds = tuple(cu_padded.tolist())
    padded_lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    real_lengths = tuple(cu_real.diff().tolist())
    if any(r > p for r, p in zip(real_lengths, padded_lengths, strict=True)):
        raise ValueError(
            f"cu_seqlens_q {cu_real.tolist()} exceeds cu_seqlens_q_padded {list(bounds)}"
        )
    if cp_size > 1 and any(p % (2 * cp_size) for p in padded_lengths):
        raise ValueError(
            f"every padded sequence length must divide by 2 * CP = {2 * cp_size}, got "
            f"{padded_lengths}; set cu_seqlens_q_padded (see split_packed_for_cp)"
        )
    if local_tokens * cp_size != bounds[-1]:
        raise ValueError(
            f"this rank holds {local_tokens} tokens but cu_seqlens_q_padded ends at "
            f"{bounds[-1]} = CP ({cp_size}) x local tokens expected"
        )
    # Megatron's THD RoPE (rope_utils._apply_rotary_pos_emb_thd) switches to absolute packed
    # positions when its table length, max(max_seqlen_q, max_seqlen_kv), equals the packed
    # length: positions would then not restart at 0 in each sequence.
    rope_length = max(params.max_seqlen_q or 0, params.max_seqlen_kv or 0)
    if rope_length == bounds[-1] and sum(p > 0 for p in padded_lengths) > 1:
        raise ValueError(
            f"max_seqlen_q/kv = {rope_length} equals the packed length; set it to the longest "
            f"padded sequence ({max(padded_lengths)}) so RoPE restarts in each sequence"
        )
    return bounds, real_lengths


def _local_token_index(bounds: tuple[int, ...], cp_size: int, cp_rank: int) -> Tensor:
    """Positions in the full padded packing of rank ``cp_rank``'s tokens, in its order."""
    if cp_size == 1:  # all tokens, in order (lengths need not be even)
        return torch.arange(bounds[-1], device=HOST)
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        chunk = (end - start) // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(torch.arange(start + c * chunk, start + (c + 1) * chunk, device=HOST))
    return torch.cat(pieces)


@functools.lru_cache(maxsize=16)
def _attention_layout(
    bounds: tuple[int, ...],
    real_lengths: tuple[int, ...],
    cp_size: int,
    cp_rank: int,
    causal: bool,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """Index and mask tensors for one batch layout (cached: every layer shares them).

    Returns key_order [T] (the gathered K/V rows, ``cat(_local_token_index(r) for r)``, put in
    full-packing order) and allowed [t, T] (bool: this rank's query i may attend to key j).
    """
    total = bounds[-1]
    gathered = torch.cat([_local_token_index(bounds, cp_size, r) for r in range(cp_size)])
    key_order = torch.argsort(gathered)
    query_index = _local_token_index(bounds, cp_size, cp_rank)

    # Built on the host from Python bounds, cached per layout, moved once (below).
    starts = torch.tensor(bounds[:-1], device=HOST)
    position = torch.arange(total, device=HOST)
    sequence = torch.bucketize(position, torch.tensor(bounds[1:], device=HOST), right=True)  # [T]
    real = position - starts[sequence] < torch.tensor(real_lengths, device=HOST)[sequence]  # [T]

    q_sequence, q_real = sequence[query_index], real[query_index]
    allowed = (q_sequence[:, None] == sequence[None, :]) & real[None, :] & q_real[:, None]
    if causal:
        allowed &= position[None, :] <= query_index[:, None]
    return key_order.to(device), allowed.to(device)
