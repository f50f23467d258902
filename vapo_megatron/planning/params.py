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


def attention_numels(hf: HFModelConfig, layout: ModelLayout) -> list[int]:
    """Elements of each attention tensor of one decoder layer on one TP rank (norms included).

    Grouped-query attention: a fused QKV (column-parallel, optional bias), per-head q/k RMSNorm
    (replicated) and the output projection (row-parallel). Multi-head latent attention
    (``hf.mla``, megatron-core 0.16.1 ``transformer/multi_latent_attention.py``, local spec):
    the q and kv down-projections are column-parallel (the TE spec keeps them whole on every TP
    rank: ``docs/scaling.md``), their RMSNorms (over q_lora_rank and kv_lora_rank) replicated,
    the up-projections column-parallel, the output projection row-parallel over heads x
    v_head_dim; without q_lora_rank one full ``linear_q_proj``."""
    tp, h, heads = layout.tp, hf.hidden_size, hf.num_attention_heads
    mla = hf.mla
    if mla is None:
        hd = hf.head_dim
        qkv_out = (heads + 2 * hf.num_key_value_heads) * hd
        return [
            qkv_out // tp * h,  # fused QKV, column-parallel
            *([qkv_out // tp] if hf.qkv_bias else []),
            *([hd, hd] if hf.qk_layernorm else []),  # per-head q and k RMSNorm, replicated
            h * (heads * hd // tp),  # output projection, row-parallel
        ]
    q_out = heads * mla.q_head_dim // tp
    if mla.q_lora_rank is None:
        query = [q_out * h]  # linear_q_proj
    else:
        query = [mla.q_lora_rank // tp * h, mla.q_lora_rank, q_out * mla.q_lora_rank]
    kv_down = (mla.kv_lora_rank + mla.qk_rope_head_dim) // tp * h
    kv_up = heads * (mla.qk_nope_head_dim + mla.v_head_dim) // tp * mla.kv_lora_rank
    return [*query, kv_down, mla.kv_lora_rank, kv_up, h * (heads * mla.v_head_dim // tp)]


def is_moe_layer(hf: HFModelConfig, layer: int) -> bool:
    """Whether decoder layer ``layer`` (0-based) has an MoE MLP: the first ``first_k_dense``
    layers of an MoE model are dense (DeepSeek-V3, GLM-4.5)."""
    return hf.is_moe and layer >= hf.first_k_dense


def layer_dense_numels(hf: HFModelConfig, layout: ModelLayout, *, moe: bool) -> list[int]:
    """Elements of each dense parameter tensor of one decoder layer on one TP rank: its two
    norms, attention and either a dense SwiGLU of intermediate_size or an MoE layer's router
    (replicated over TP and EP) and shared experts (one SwiGLU of moe_intermediate_size x
    num_shared_experts, split over TP like a dense MLP, megatron's ``SharedExpertMLP``)."""
    tp, h = layout.tp, hf.hidden_size
    layer = [h, h, *attention_numels(hf, layout)]  # input and pre-MLP RMSNorm weights
    width = hf.intermediate_size
    if moe:
        layer.append(hf.num_experts * h)  # router
        width = hf.moe_intermediate_size * hf.num_shared_experts
    if width:
        layer += [2 * width // tp * h, h * (width // tp)]  # fused gate/up (column), down (row)
    return layer


def layer_replicated_count(hf: HFModelConfig, *, moe: bool) -> int:
    """Parameters of one decoder layer every TP rank holds whole: its RMSNorms (the q/k norms,
    MLA's q and kv norms) and an MoE layer's router."""
    count = 2 * hf.hidden_size
    if hf.mla is not None:
        count += (hf.mla.q_lora_rank or 0) + hf.mla.kv_lora_rank
    elif hf.qk_layernorm:
        count += 2 * hf.head_dim
    return count + (hf.num_experts * hf.hidden_size if moe else 0)


def layer_expert_numels(hf: HFModelConfig, layout: ModelLayout) -> list[int]:
    """Elements of each expert tensor of one MoE layer on one rank: its num_experts / EP
    local experts, each a fused gate/up and a down projection split over ETP."""
    if not hf.is_moe:
        return []
    etp, h, f = layout.expert_tp, hf.hidden_size, hf.moe_intermediate_size
    return [2 * f // etp * h, h * (f // etp)] * (hf.num_experts // layout.ep)


def mtp_numels(hf: HFModelConfig, layout: ModelLayout) -> tuple[list[int], list[int]]:
    """(dense, expert) elements of the multi-token-prediction layers on the last stage
    (megatron-core 0.16.1 ``transformer/multi_token_prediction.py``): per layer ``enorm`` and
    ``hnorm`` (h each), ``eh_proj`` (2h -> h, column-parallel), a decoder layer like the last
    one (MoE in every published model) and its ``final_layernorm``. The embedding they read is
    the model's (under PP the last stage builds its own copy: :func:`shard_numels`), their
    output layer the model's."""
    h, dense, expert = hf.hidden_size, [], []
    moe = is_moe_layer(hf, hf.num_layers - 1)
    for _ in range(hf.mtp_num_layers):
        dense += [h, h, 2 * h * (h // layout.tp), *layer_dense_numels(hf, layout, moe=moe), h]
        expert += layer_expert_numels(hf, layout) if moe else []
    return dense, expert


def shard_numels(
    hf: HFModelConfig, layout: ModelLayout, *, head: Head, pp_rank: int, mtp: bool = False
) -> tuple[list[int], list[int]]:
    """(dense, expert) elements of each parameter tensor one rank at ``pp_rank`` holds (every
    TP rank of a stage holds the same shapes, norms replicated). ``mtp``: the policy's
    multi-token-prediction layers are built (``policy.mtp.loss_weight`` > 0: on the last
    stage, :func:`mtp_numels`); False: carried as files, nothing built (a critic never)."""
    tp, pp, h = layout.tp, layout.pp, hf.hidden_size
    per_stage = hf.num_layers // pp
    dense: list[int] = []
    expert: list[int] = []
    for layer in range(pp_rank * per_stage, (pp_rank + 1) * per_stage):
        moe = is_moe_layer(hf, layer)
        dense += layer_dense_numels(hf, layout, moe=moe)
        expert += layer_expert_numels(hf, layout) if moe else []
    vocab_shard = hf.padded_vocab_size(tp) // tp * h
    first, last = pp_rank == 0, pp_rank == pp - 1
    mtp = mtp and head == "lm" and hf.mtp_num_layers > 0
    if first or (last and mtp):  # MTP reads the embedding on the last stage
        dense.append(vocab_shard)
    if last and mtp:
        mtp_dense, mtp_expert = mtp_numels(hf, layout)
        dense += mtp_dense
        expert += mtp_expert
    if last:
        dense.append(h)  # final norm
        if head == "value":
            dense.append(h)  # ValueHead: Linear(h, 1), replicated
        elif not (hf.tie_word_embeddings and first):
            # Tied under PP: the last stage keeps its own copy, all-reduced with the first's.
            dense.append(vocab_shard)
    return dense, expert


def shard_tensor_numels(
    hf: HFModelConfig, layout: ModelLayout, *, head: Head, pp_rank: int, mtp: bool = False
) -> list[int]:
    """Elements of each parameter tensor one rank at ``pp_rank`` holds, dense and expert."""
    dense, expert = shard_numels(hf, layout, head=head, pp_rank=pp_rank, mtp=mtp)
    return dense + expert


def shard_param_split(
    hf: HFModelConfig, layout: ModelLayout, *, head: Head, pp_rank: int, mtp: bool = False
) -> tuple[int, int]:
    """(dense, expert) parameters one rank at ``pp_rank`` holds: what DDP puts in its dense
    buffers and in its expert-parallel buffers."""
    dense, expert = shard_numels(hf, layout, head=head, pp_rank=pp_rank, mtp=mtp)
    return sum(dense), sum(expert)


def shard_param_count(
    hf: HFModelConfig, layout: ModelLayout, *, head: Head, pp_rank: int, mtp: bool = False
) -> int:
    """Parameters one rank at ``pp_rank`` holds; equals ``sum(p.numel())`` over its
    megatron-core ``GPTModel`` chunks."""
    return sum(shard_param_split(hf, layout, head=head, pp_rank=pp_rank, mtp=mtp))


def total_param_count(hf: HFModelConfig, *, head: Head, mtp: bool = True) -> int:
    """Parameters of the whole model (TP 1, PP 1, EP 1, without Megatron's vocabulary
    padding), with its multi-token-prediction layers (the published size) unless ``mtp`` is
    False (what vLLM loads), whether or not megatron builds them."""
    padded = shard_param_count(hf, ModelLayout(), head=head, pp_rank=0)
    padding_rows = hf.padded_vocab_size(1) - hf.vocab_size
    untied_lm = head == "lm" and not hf.tie_word_embeddings
    total = padded - padding_rows * hf.hidden_size * (2 if untied_lm else 1)
    layers = sum(sum(part) for part in mtp_numels(hf, ModelLayout())) if head == "lm" else 0
    return total + (layers if mtp else 0)


def moe_layer_count(hf: HFModelConfig) -> int:
    """MoE layers of the decoder (not counting multi-token-prediction layers)."""
    return sum(is_moe_layer(hf, layer) for layer in range(hf.num_layers))


def active_param_count(hf: HFModelConfig, *, head: Head, mtp: bool = False) -> int:
    """Parameters one token passes through (MoE: top-k of the routed experts, every shared
    expert; dense: all); without the multi-token-prediction layers unless ``mtp``."""
    total = total_param_count(hf, head=head, mtp=mtp)
    if not hf.is_moe:
        return total
    layers = moe_layer_count(hf) + (hf.mtp_num_layers if mtp and head == "lm" else 0)
    expert = sum(layer_expert_numels(hf, ModelLayout())) * layers
    return total - expert + expert * hf.moe_top_k // hf.num_experts
