"""Parameters of a megatron-core ``GPTModel`` by rank, from the HF config and the layout: the
exact counts the memory planner multiplies by byte sizes (checked against real CPU builds in
``tests/unit/planning/test_memory_plan.py``)."""

from __future__ import annotations

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.models.config import Head, HFModelConfig


def shard_tensor_numels(
    hf: HFModelConfig, layout: ModelLayout, *, head: Head, pp_rank: int
) -> list[int]:
    """Elements of each parameter tensor one rank at ``pp_rank`` holds (every TP rank of a
    stage holds the same shapes, norms replicated)."""
    tp, pp = layout.tp, layout.pp
    h, hd = hf.hidden_size, hf.head_dim
    qkv_out = (hf.num_attention_heads + 2 * hf.num_key_value_heads) * hd
    layer = [
        h,  # input RMSNorm weight
        h,  # pre-MLP RMSNorm weight
        qkv_out // tp * h,  # fused QKV, column-parallel
        *([qkv_out // tp] if hf.qkv_bias else []),
        h * (hf.num_attention_heads * hd // tp),  # output projection, row-parallel
        2 * hf.intermediate_size // tp * h,  # fused gate/up, column-parallel
        h * (hf.intermediate_size // tp),  # down projection, row-parallel
    ]
    numels = layer * (hf.num_layers // pp)
    vocab_shard = hf.padded_vocab_size(tp) // tp * h
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        numels.append(vocab_shard)
    if last:
        numels.append(h)  # final norm
        if head == "value":
            numels.append(h)  # ValueHead: Linear(h, 1), replicated
        elif not (hf.tie_word_embeddings and first):
            # Tied under PP: the last stage keeps its own copy, all-reduced with the first's.
            numels.append(vocab_shard)
    return numels


def shard_param_count(hf: HFModelConfig, layout: ModelLayout, *, head: Head, pp_rank: int) -> int:
    """Parameters one rank at ``pp_rank`` holds; equals ``sum(p.numel())`` over its
    megatron-core ``GPTModel`` chunks."""
    return sum(shard_tensor_numels(hf, layout, head=head, pp_rank=pp_rank))


def total_param_count(hf: HFModelConfig, *, head: Head) -> int:
    """Parameters of the whole model (TP 1, PP 1, without Megatron's vocabulary padding)."""
    padded = shard_param_count(hf, ModelLayout(), head=head, pp_rank=0)
    padding_rows = hf.padded_vocab_size(1) - hf.vocab_size
    untied_lm = head == "lm" and not hf.tie_word_embeddings
    return padded - padding_rows * hf.hidden_size * (2 if untied_lm else 1)
