"""Bytes one model's update keeps for backward on its first pipeline stage (estimated; the
terms are listed in ``planning/memory.py``'s module doc), dense and mixture-of-experts.

MoE layers (megatron-core 0.16.1 ``MoEAlltoAllTokenDispatcher``, ``moe/token_dispatcher.py``):
the router keeps its fp32 probabilities over every expert per token; each token goes to top-k
experts, so a rank's experts see top-k copies of its tokens (all-to-all over EP, then
gathered over expert TP when ETP > 1: tokens / TP x ETP x top-k rows per rank, balanced
routing assumed); per routed row the experts keep their input (h) and, split over ETP, the
fc1 output (2 f) and the activation (f). The all-to-all's send and receive buffers (top-k x
tokens / TP rows of h each) are live for the layer whose forward or backward is running.
"""

from __future__ import annotations

import math

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.models.config import Head, HFModelConfig
from vapo_megatron.models.logprobs import LOGPROB_CHUNK_TOKENS
from vapo_megatron.planning.workload import Recompute, Workload

LOGIT_BYTES = 4
"""Bytes per logit element of the policy's log-probs: bf16 logits kept + bf16 gradient
(measured on CPU, tests/unit/models/test_logprobs_chunked.py)."""
LOGIT_CHUNK_BYTES = 16
"""fp32 temporaries per element of one log-prob chunk (measured on CPU, same test)."""


def layer_elements(hf: HFModelConfig, layout: ModelLayout) -> tuple[float, float]:
    """(split over TP under sequence parallelism, replicated without it): bf16 elements one
    token of one layer keeps for backward, summed over the TP ranks. A model with dense first
    layers and MoE ones (DeepSeek-V3, GLM-4.5) is counted at its larger layer for every layer.
    Multi-head latent attention keeps its per-head q, k (nope + rope) and v, the attention
    output, and, whole on every TP rank, the compressed q and kv (norm and up-projection
    inputs)."""
    mla, cp, h = hf.mla, layout.cp, hf.hidden_size
    replicated = 4 * h  # norm inputs and projection inputs
    if mla is None:
        q = hf.num_attention_heads * hf.head_dim
        kv = hf.num_key_value_heads * hf.head_dim
        sharded = q + 2 * kv * cp + q  # q, k, v (+ CP ring copies), attention output
    else:
        heads = hf.num_attention_heads
        qk, v = heads * mla.q_head_dim, heads * mla.v_head_dim
        sharded = qk + (qk + v) * cp + v
        compressed = (mla.q_lora_rank or 0) + mla.kv_lora_rank + mla.qk_rope_head_dim
        replicated += 2 * compressed
    mlp = 3 * hf.intermediate_size if hf.first_k_dense or not hf.is_moe else 0  # fc1 out, fc2 in
    if hf.is_moe:
        etp, f = layout.expert_tp, hf.moe_intermediate_size
        moe = hf.moe_top_k * (etp * h + 3 * f)  # routed rows: h, 2f, f
        moe += 2 * hf.num_experts  # fp32 router probabilities
        moe += 3 * f * hf.num_shared_experts  # shared experts: fc1 out, fc2 in
        mlp = max(mlp, moe)
    return sharded + mlp, replicated


def dispatch_buffer_bytes(hf: HFModelConfig, layout: ModelLayout, tokens: int) -> int:
    """The all-to-all send and receive buffers of one MoE layer (bf16, top-k rows of h per
    token of this TP rank); 0 for a dense model."""
    if not hf.is_moe:
        return 0
    return 2 * 2 * math.ceil(tokens / layout.tp) * hf.moe_top_k * hf.hidden_size


def activation_bytes(hf: HFModelConfig, layout: ModelLayout, work: Workload, *, head: Head) -> int:
    """Bytes saved for backward on the first stage during one model's update (module doc)."""
    tp, cp, pp = layout.tp, layout.cp, layout.pp
    tokens = math.ceil(max(work.micro_batch_tokens, work.sequence_len) / cp)
    sharded, replicated = layer_elements(hf, layout)
    if layout.sequence_parallel:
        per_token_layer = 2 * (sharded + replicated) / tp
    else:
        per_token_layer = 2 * (sharded / tp + replicated)
    layer = per_token_layer * tokens
    layer_input = tokens * 2 * hf.hidden_size / (tp if layout.sequence_parallel else 1)
    in_flight = 1.0 if pp == 1 else 1.0 + ((pp - 1) / (pp * layout.vpp) if layout.vpp else 0.0)
    recompute = work.policy_recompute if head == "lm" else work.critic_recompute
    stage, live = stage_and_live(recompute, hf.num_layers // pp, layer, layer_input)
    total = stage * pp * in_flight + live + dispatch_buffer_bytes(hf, layout, tokens)
    if head == "lm":
        vocab_local = hf.padded_vocab_size(tp) // tp
        total += tokens * vocab_local * LOGIT_BYTES
        total += min(tokens, LOGPROB_CHUNK_TOKENS) * vocab_local * LOGIT_CHUNK_BYTES
    return math.ceil(total)


def stage_and_live(
    recompute: Recompute, stage_layers: int, layer: float, layer_input: float
) -> tuple[float, float]:
    """(bytes a stage keeps, bytes live during one backward) under the model's recompute."""
    granularity, method, num_layers = recompute
    if granularity != "full":
        return stage_layers * layer, layer
    if method == "uniform":  # one recomputed group at a time
        return math.ceil(stage_layers / num_layers) * layer_input, num_layers * layer
    # block: the first num_layers of the stage recomputed, the rest stored
    recomputed = min(num_layers, stage_layers)
    return recomputed * layer_input + (stage_layers - recomputed) * layer, layer
