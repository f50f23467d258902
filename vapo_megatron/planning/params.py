"""Parameters of a megatron-core ``GPTModel`` by rank, from the HF config and the layout: the
exact counts the memory planner multiplies by byte sizes (checked against real CPU builds in
``tests/unit/planning/test_memory_plan.py``, MoE ones against meta builds in
``tests/unit/planning/test_moe_plan.py``).

Dense and expert parameters are counted apart because megatron keeps them apart: the expert
weights (``mlp.experts.*``, ``allreduce=False``) are split over expert parallelism (EP) and
expert tensor parallelism (ETP), live in DDP's ``expert_parallel_buffers`` and are sharded by
the distributed optimizer over the expert-DP group (world / (ETP x EP x PP) ranks); everything
else, the router included (``TopKRouter.weight``, [experts, hidden], in the params dtype,
replicated over TP and EP), is split over TP and sharded over DP x CP (world / (TP x PP)).
Read in megatron-core 0.16.1: ``transformer/moe/router.py``, ``moe/experts.py``
(``SequentialMLP``; ``TEGroupedMLP`` has the same shapes per local expert),
``distributed/distributed_data_parallel.py`` (``allreduce`` splits the buffers).
"""

from __future__ import annotations

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.models.config import Head, HFModelConfig


def layer_dense_numels(hf: HFModelConfig, layout: ModelLayout) -> list[int]:
    """Elements of each dense parameter tensor of one decoder layer on one TP rank."""
    tp, h, hd = layout.tp, hf.hidden_size, hf.head_dim
    qkv_out = (hf.num_attention_heads + 2 * hf.num_key_value_heads) * hd
    layer = [
        h,  # input RMSNorm weight
        h,  # pre-MLP RMSNorm weight
        qkv_out // tp * h,  # fused QKV, column-parallel
        *([qkv_out // tp] if hf.qkv_bias else []),
        *([hd, hd] if hf.qk_layernorm else []),  # per-head q and k RMSNorm, replicated
        h * (hf.num_attention_heads * hd // tp),  # output projection, row-parallel
    ]
    if hf.is_moe:
        layer.append(hf.num_experts * h)  # router, replicated over TP and EP
    else:
        layer += [
            2 * hf.intermediate_size // tp * h,  # fused gate/up, column-parallel
            h * (hf.intermediate_size // tp),  # down projection, row-parallel
        ]
    return layer


def layer_expert_numels(hf: HFModelConfig, layout: ModelLayout) -> list[int]:
    """Elements of each expert tensor of one decoder layer on one rank: its num_experts / EP
    local experts, each a fused gate/up and a down projection split over ETP."""
    if not hf.is_moe:
        return []
    etp, h, f = layout.expert_tp, hf.hidden_size, hf.moe_intermediate_size
    return [2 * f // etp * h, h * (f // etp)] * (hf.num_experts // layout.ep)


def shard_numels(
    hf: HFModelConfig, layout: ModelLayout, *, head: Head, pp_rank: int
) -> tuple[list[int], list[int]]:
    """(dense, expert) elements of each parameter tensor one rank at ``pp_rank`` holds (every
    TP rank of a stage holds the same shapes, norms replicated)."""
    tp, pp, h = layout.tp, layout.pp, hf.hidden_size
    layers = hf.num_layers // pp
    dense = layer_dense_numels(hf, layout) * layers
    expert = layer_expert_numels(hf, layout) * layers
    vocab_shard = hf.padded_vocab_size(tp) // tp * h
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        dense.append(vocab_shard)
    if last:
        dense.append(h)  # final norm
        if head == "value":
            dense.append(h)  # ValueHead: Linear(h, 1), replicated
        elif not (hf.tie_word_embeddings and first):
            # Tied under PP: the last stage keeps its own copy, all-reduced with the first's.
            dense.append(vocab_shard)
    return dense, expert


def shard_tensor_numels(
    hf: HFModelConfig, layout: ModelLayout, *, head: Head, pp_rank: int
) -> list[int]:
    """Elements of each parameter tensor one rank at ``pp_rank`` holds, dense and expert."""
    dense, expert = shard_numels(hf, layout, head=head, pp_rank=pp_rank)
    return dense + expert


def shard_param_split(
    hf: HFModelConfig, layout: ModelLayout, *, head: Head, pp_rank: int
) -> tuple[int, int]:
    """(dense, expert) parameters one rank at ``pp_rank`` holds: what DDP puts in its dense
    buffers and in its expert-parallel buffers."""
    dense, expert = shard_numels(hf, layout, head=head, pp_rank=pp_rank)
    return sum(dense), sum(expert)


def shard_param_count(hf: HFModelConfig, layout: ModelLayout, *, head: Head, pp_rank: int) -> int:
    """Parameters one rank at ``pp_rank`` holds; equals ``sum(p.numel())`` over its
    megatron-core ``GPTModel`` chunks."""
    return sum(shard_param_split(hf, layout, head=head, pp_rank=pp_rank))


def total_param_count(hf: HFModelConfig, *, head: Head) -> int:
    """Parameters of the whole model (TP 1, PP 1, EP 1, without Megatron's vocabulary
    padding)."""
    padded = shard_param_count(hf, ModelLayout(), head=head, pp_rank=0)
    padding_rows = hf.padded_vocab_size(1) - hf.vocab_size
    untied_lm = head == "lm" and not hf.tie_word_embeddings
    return padded - padding_rows * hf.hidden_size * (2 if untied_lm else 1)


def active_param_count(hf: HFModelConfig, *, head: Head) -> int:
    """Parameters one token passes through (MoE: top-k of the experts; dense: all)."""
    if not hf.is_moe:
        return total_param_count(hf, head=head)
    expert = sum(layer_expert_numels(hf, ModelLayout())) * hf.num_layers
    return total_param_count(hf, head=head) - expert + expert * hf.moe_top_k // hf.num_experts
