"""megatron-core's local (no Transformer Engine) GPT layer spec with our core attention.

``local_layer_spec(...)`` is ``get_gpt_layer_local_spec(...)`` with
``submodules.self_attention.submodules.core_attention`` set to
``ContextParallelDotProductAttention``, so the local spec runs with context parallelism and
packed (THD) sequences::

    model = GPTModel(config, transformer_layer_spec=local_layer_spec(), vocab_size=...,
                     max_sequence_length=..., position_embedding_type="rope")

RoPE needs no change: under CP the BSHD path picks this rank's chunks of the position table
(``rope_utils.get_pos_emb_on_this_cp_rank``) and the THD path
(``rope_utils._apply_rotary_pos_emb_thd``, plain torch) restarts positions at 0 in each
packed sequence from ``cu_seqlens_q_padded`` and takes chunks r and 2 * CP - 1 - r, provided
``max_seqlen_q`` is the longest padded sequence (the attention checks it).
"""

from __future__ import annotations

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from vapo_megatron.models.attention import ContextParallelDotProductAttention


def local_layer_spec(
    *,
    normalization: str = "RMSNorm",
    qk_layernorm: bool = False,
    num_experts: int | None = None,
    multi_latent_attention: bool = False,
) -> ModuleSpec:
    """The local GPT layer spec with CP- and THD-capable core attention.

    normalization: "RMSNorm" or "LayerNorm" (as in ``get_gpt_layer_local_spec``).
    qk_layernorm: normalise queries and keys per head before RoPE.
    num_experts: None for a dense MLP; else megatron's ``MoELayer`` with ``SequentialMLP``
    experts (one local MLP per expert: no grouped GEMM without Transformer Engine).
    multi_latent_attention: DeepSeek-V3's ``MLASelfAttention`` (its q/kv norms are
    ``qk_layernorm``); the core attention then gets different query and value widths.
    """
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=False,
        qk_layernorm=qk_layernorm,
        multi_latent_attention=multi_latent_attention,
        normalization=normalization,
    )
    spec.submodules.self_attention.submodules.core_attention = ContextParallelDotProductAttention
    return spec
