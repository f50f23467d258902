"""HF ``config.json`` -> megatron-core ``TransformerConfig`` and ``GPTModel`` arguments.

``HFModelConfig.from_hf(config_dict)`` reads the facts a Megatron model needs from a Hugging
Face config (Qwen2/Qwen2.5, Llama 3, Qwen3 and Qwen3-MoE families) and rejects anything the
Megatron model would compute differently. Both config dialects are read: transformers 4.x (``rope_theta`` and
``rope_scaling`` at the top level, ``torch_dtype``) and 5.x (``rope_parameters``, ``dtype``).

Decisions:

- Llama 3 RoPE scaling (``rope_type: "llama3"``) is supported exactly when
  ``low_freq_factor == 1``, ``high_freq_factor == 4`` and
  ``original_max_position_embeddings == 8192`` (every published Llama 3.1/3.2/3.3): those are
  hard-coded in megatron-core's ``RotaryEmbedding._apply_scaling``, which otherwise matches
  transformers' ``_compute_llama3_parameters`` line by line; only ``factor`` is a parameter
  (``GPTModel(rope_scaling=True, rope_scaling_factor=factor)``). Other values, and every
  other RoPE type (linear, dynamic, yarn, longrope), raise.
- Llama ``attention_bias`` / ``mlp_bias`` and Qwen2/Qwen3 ``use_sliding_window`` raise when
  true, and so does Qwen3's ``attention_bias``: no published Llama 3, Qwen2.5 or Qwen3
  checkpoint sets them.
- Qwen3 normalises queries and keys per head (``q_norm``/``k_norm``, RMSNorm over ``head_dim``,
  before RoPE): megatron's ``qk_layernorm``. Its ``head_dim`` is explicit and need not be
  hidden / heads (Qwen3-32B: 64 x 128 = 8192 against hidden 5120): megatron's ``kv_channels``.
- Qwen3-MoE: every layer's MLP is an MoE (``num_experts`` SwiGLU experts of width
  ``moe_intermediate_size``, softmax router, top ``num_experts_per_tok``, renormalised when
  ``norm_topk_prob``, no shared expert). ``mlp_only_layers`` (dense layers among the MoE
  ones) and ``decoder_sparse_step`` != 1 (MoE every k-th layer) are refused, naming them:
  every published Qwen3-MoE has every layer an MoE.
- The checkpoint dtype is reported (``dtype``) but not turned into Megatron arguments: the
  training precision is the trainer's choice; an exporter casts back to ``dtype``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from vapo_megatron.config.moe import MoESettings

CONFIG_NAME = "config.json"
"""The file of an HF model directory that holds its architecture."""

LayerSpecKind = Literal["local", "te"]
"""Which GPT layer spec a model was built with: megatron-core's local one or Transformer
Engine's. Parameter names differ (``weights/record.py``'s docstring)."""

Family = Literal["qwen2", "llama", "qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe"]
Head = Literal["lm", "value"]
"""The model's output: 'lm' (policy: logits over the vocabulary) or 'value' (critic: one scalar
per token)."""

# model_type -> HF architectures accepted for it; the first one is what an exported policy
# declares, the second what an exported critic (a one-label sequence classifier) declares.
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "qwen2": ("Qwen2ForCausalLM", "Qwen2ForSequenceClassification"),
    "llama": ("LlamaForCausalLM", "LlamaForSequenceClassification"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3ForSequenceClassification"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeForSequenceClassification"),
    # Kimi-K2 and Moonlight publish model_type deepseek_v3 (their own modeling code, the
    # same architecture): they are this family at other sizes.
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3ForSequenceClassification"),
    "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeForSequenceClassification"),
}
FAMILY_ALIASES = {"kimi_k2": "deepseek_v3"}
"""model_types read as another family: Kimi-K2's config.json says ``kimi_k2`` with
``architectures: [DeepseekV3ForCausalLM]`` and DeepSeek-V3's fields (other sizes, no groups,
YaRN factor 32)."""
SIGMOID_FAMILIES = ("deepseek_v3", "glm4_moe")
"""Families whose router is DeepSeek-V3's: sigmoid scores, an expert-score bias used for the
choice only, group-limited top-k, a scaling factor, shared experts, first layers dense."""

# Fixed inside megatron-core 0.16.1's RotaryEmbedding._apply_scaling.
_MEGATRON_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class MLAShape:
    """Multi-head latent attention of a DeepSeek-V3 model (HF field names)."""

    q_lora_rank: int | None
    """Width of the compressed query (``q_a_proj``); None: a full ``q_proj`` (Moonlight)."""
    kv_lora_rank: int
    """Width of the compressed key/value (rows of ``kv_a_proj_with_mqa`` before the RoPE key)."""
    qk_nope_head_dim: int
    """Per-head query/key width without RoPE (megatron's ``qk_head_dim``)."""
    qk_rope_head_dim: int
    """Per-head query width with RoPE, and the one RoPE key's (``qk_pos_emb_head_dim``)."""
    v_head_dim: int
    """Per-head value width."""
    yarn: tuple[tuple[str, float], ...] = ()
    """YaRN scaling as megatron's MLA config fields (``rotary_scaling_factor``, ``mscale``,
    ``mscale_all_dim``, ``beta_fast``, ``beta_slow``, ``original_max_position_embeddings``);
    empty: plain RoPE."""

    @property
    def q_head_dim(self) -> int:
        """Query/key width of one head."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, kw_only=True)
class HFModelConfig:
    """What the Megatron model and the HF<->Megatron record need from an HF config."""

    family: Family
    """Model family ('qwen2' covers Qwen2 and Qwen2.5)."""
    num_layers: int
    """Decoder layers (``num_hidden_layers``)."""
    hidden_size: int
    """Width of the residual stream."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (query groups, GQA); equals num_attention_heads without GQA."""
    head_dim: int
    """Width of one attention head (``head_dim``, else hidden_size // num_attention_heads)."""
    intermediate_size: int
    """Width of the SwiGLU MLP (gate and up projections each)."""
    vocab_size: int
    """Rows of the HF embedding and lm_head (before Megatron's padding)."""
    max_position_embeddings: int
    """Longest sequence the model was trained for."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    rope_theta: float
    """RoPE base."""
    llama3_rope_factor: float | None
    """``factor`` of Llama 3 RoPE scaling; None: plain RoPE."""
    qkv_bias: bool
    """Whether q/k/v projections have biases (Qwen2: yes; Llama 3: no)."""
    tie_word_embeddings: bool
    """Whether lm_head shares the embedding matrix."""
    initializer_range: float
    """Std of the normal init (used for Megatron's random init)."""
    dtype: torch.dtype
    """dtype of the checkpoint's tensors (``dtype`` or ``torch_dtype``; float32 when absent,
    as transformers loads it)."""
    qk_layernorm: bool = False
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3's ``q_norm``/``k_norm``)."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0: a dense model."""
    moe_top_k: int = 0
    """Experts each token is routed to (``num_experts_per_tok``); 0 for a dense model."""
    moe_intermediate_size: int = 0
    """Width of one expert's SwiGLU MLP (gate and up projections each); 0 for a dense model."""
    norm_topk_prob: bool = True
    """Whether the top-k routing probabilities are renormalised to sum to 1 (Qwen3-MoE's
    ``norm_topk_prob``; every published Qwen3-MoE sets it)."""
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    """Router score function: Qwen3-MoE's softmax, or DeepSeek-V3/GLM-4.5's sigmoid with an
    expert-score bias (``mlp.gate.e_score_correction_bias``) that only chooses experts."""
    moe_num_groups: int = 1
    """Expert groups of group-limited routing (``n_group``); 1: no groups."""
    moe_group_topk: int = 1
    """Groups a token may route into (``topk_group``)."""
    routed_scaling_factor: float = 1.0
    """Factor on the routed experts' weights (``routed_scaling_factor``)."""
    num_shared_experts: int = 0
    """Shared experts (``n_shared_experts``), one SwiGLU of width
    ``moe_intermediate_size * num_shared_experts`` every token goes through."""
    first_k_dense: int = 0
    """The first layers are dense MLPs of width ``intermediate_size``
    (``first_k_dense_replace``); the rest are MoE layers."""
    mtp_num_layers: int = 0
    """Multi-token-prediction layers after the decoder (``num_nextn_predict_layers``), HF
    ``model.layers.{num_layers + k}``: built, converted and exported, never used by RL."""
    partial_rotary_factor: float = 1.0
    """Share of each head's dims that RoPE rotates (GLM-4.5: 0.5, the first half)."""
    mla: MLAShape | None = None
    """DeepSeek-V3's multi-head latent attention (low-rank q and kv, a decoupled RoPE key
    shared by all heads); None: grouped-query attention."""

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are mixtures of experts."""
        return self.num_experts > 0

    @classmethod
    def from_hf(cls, hf_config: Mapping[str, Any]) -> HFModelConfig:
        """Read an HF ``config.json`` dict; ``ValueError`` for anything unsupported."""
        model_type = _check_supported(hf_config)
        num_heads = _required(hf_config, "num_attention_heads")
        hidden_size = _required(hf_config, "hidden_size")
        rope = _read_rope(hf_config, model_type)
        yarn = rope.pop("yarn")
        mla = _read_mla(hf_config, yarn) if model_type == "deepseek_v3" else None
        moe: dict[str, Any] = {}
        if model_type == "qwen3_moe":
            moe = _read_moe(hf_config)
        elif model_type in SIGMOID_FAMILIES:
            moe = _read_sigmoid_moe(hf_config)
        return cls(
            family=model_type,
            num_layers=_required(hf_config, "num_hidden_layers"),
            hidden_size=hidden_size,
            num_attention_heads=num_heads,
            num_key_value_heads=hf_config.get("num_key_value_heads") or num_heads,
            head_dim=(
                mla.v_head_dim
                if mla is not None
                else hf_config.get("head_dim") or hidden_size // num_heads
            ),
            intermediate_size=_required(hf_config, "intermediate_size"),
            vocab_size=_required(hf_config, "vocab_size"),
            max_position_embeddings=_required(hf_config, "max_position_embeddings"),
            rms_norm_eps=float(_required(hf_config, "rms_norm_eps")),
            qkv_bias=model_type == "qwen2"
            or (model_type == "glm4_moe" and bool(hf_config.get("attention_bias"))),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            initializer_range=float(hf_config.get("initializer_range", 0.02)),
            dtype=_read_dtype(hf_config),
            qk_layernorm=model_type in ("qwen3", "qwen3_moe", "deepseek_v3")
            or (model_type == "glm4_moe" and bool(hf_config.get("use_qk_norm"))),
            mla=mla,
            **rope,
            **moe,
        )

    def hf_architecture(self, head: Head) -> str:
        """The ``architectures`` entry of an exported checkpoint with this head."""
        policy, critic = SUPPORTED_ARCHITECTURES[self.family]
        return policy if head == "lm" else critic

    def padded_vocab_size(self, tp_size: int, make_vocab_size_divisible_by: int = 128) -> int:
        """Megatron's vocabulary: vocab_size rounded up to a multiple of divisible_by * tp_size."""
        multiple = make_vocab_size_divisible_by * tp_size
        return -(-self.vocab_size // multiple) * multiple

    def transformer_config_kwargs(self, moe: MoESettings | None = None) -> dict[str, Any]:
        """Architecture arguments of ``TransformerConfig`` (parallelism and precision excluded).

        ``kv_channels`` is the explicit head_dim (Qwen3: not hidden / heads). An MoE model adds
        its experts and router, plus ``moe``'s training settings (None: ``MoESettings()``).
        Routing, transformers' ``Qwen3MoeTopKRouter.forward`` against megatron-core 0.16.1's
        ``moe_utils.topk_routing_with_score_function`` (score function softmax):

        - transformers: p = softmax(logits) in fp32 over all experts, top-k of p, then with
          ``norm_topk_prob`` p_topk / sum(p_topk).
        - megatron, ``moe_router_pre_softmax=False``: top-k of the logits, then softmax over
          those k logits = exp(l_i) / sum_topk exp(l_j) = p_i / sum(p_topk): the renormalised
          case (top-k of logits and of softmax pick the same experts, softmax being monotonic).
        - megatron, ``moe_router_pre_softmax=True``: softmax over all experts, then top-k, no
          renormalisation: ``norm_topk_prob=False``.

        So ``moe_router_pre_softmax = not norm_topk_prob`` (top_k = 1 with renormalisation,
        a constant weight of 1, megatron refuses: raised here). No expert bias, no group-limited
        routing, no scaling factor, no capacity (token dropping): as transformers.
        """
        kwargs: dict[str, Any] = {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_query_groups": self.num_key_value_heads,
            "kv_channels": self.head_dim,
            "ffn_hidden_size": self.intermediate_size,
            "normalization": "RMSNorm",
            "layernorm_epsilon": self.rms_norm_eps,
            "gated_linear_unit": True,
            "activation_func": F.silu,
            "add_bias_linear": False,
            "add_qkv_bias": self.qkv_bias,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            "init_method_std": self.initializer_range,
            "qk_layernorm": self.qk_layernorm,
        }
        if self.mla is not None:
            kwargs |= self._mla_kwargs()
        if not self.is_moe:
            return kwargs
        if self.moe_top_k == 1 and self.norm_topk_prob:
            raise ValueError(
                "num_experts_per_tok=1 with norm_topk_prob=true (every weight 1) is refused by "
                "megatron-core's router (softmax over one logit has no gradient)"
            )
        return kwargs | {
            "num_moe_experts": self.num_experts,
            "moe_router_topk": self.moe_top_k,
            "moe_ffn_hidden_size": self.moe_intermediate_size,
            "moe_router_score_function": self.router_score,
            "moe_router_pre_softmax": not self.norm_topk_prob,
            **(self._sigmoid_router_kwargs() if self.router_score == "sigmoid" else {}),
            **(moe or MoESettings()).transformer_config_kwargs(),
        }

    def _sigmoid_router_kwargs(self) -> dict[str, Any]:
        """DeepSeek-V3/GLM-4.5's router and MLP pattern in megatron's fields (``_read_sigmoid_moe``):
        the expert bias is megatron's ``expert_bias`` buffer; whether it moves during training
        is ``MoESettings.router_bias_update_rate`` (0 by default: frozen)."""
        groups = self.moe_num_groups > 1
        return {
            "moe_router_enable_expert_bias": True,
            "moe_router_num_groups": self.moe_num_groups if groups else None,
            "moe_router_group_topk": self.moe_group_topk if groups else None,
            "moe_router_topk_scaling_factor": (
                self.routed_scaling_factor if self.routed_scaling_factor != 1.0 else None
            ),
            "moe_shared_expert_intermediate_size": (
                self.moe_intermediate_size * self.num_shared_experts or None
            ),
            "moe_layer_freq": [0] * self.first_k_dense
            + [1] * (self.num_layers - self.first_k_dense),
        }

    def _mla_kwargs(self) -> dict[str, Any]:
        """``MLATransformerConfig`` fields. RoPE lives in the attention under MLA
        (``GPTModel`` builds none), so ``rope_theta`` goes to ``rotary_base`` here; plain RoPE
        is megatron's ``rope`` with the scaling factor 1 (mscale 1)."""
        mla = self.mla
        yarn = dict(mla.yarn)
        return {
            "multi_latent_attention": True,
            "q_lora_rank": mla.q_lora_rank,
            "kv_lora_rank": mla.kv_lora_rank,
            "qk_head_dim": mla.qk_nope_head_dim,
            "qk_pos_emb_head_dim": mla.qk_rope_head_dim,
            "v_head_dim": mla.v_head_dim,
            "rope_type": "yarn" if yarn else "rope",
            "rotary_base": self.rope_theta,
            "rotary_scaling_factor": yarn.pop("rotary_scaling_factor", 1.0),
            "mscale_all_dim": yarn.pop("mscale_all_dim", 0.0),
            **yarn,
            "rotary_interleaved": False,
        }

    def gpt_model_kwargs(
        self, tp_size: int, head: Head = "lm", make_vocab_size_divisible_by: int = 128
    ) -> dict[str, Any]:
        """``GPTModel`` arguments other than config, layer spec and pipeline placement.

        A critic (head='value') never ties: its output layer becomes the value head.
        """
        kwargs: dict[str, Any] = {
            "vocab_size": self.padded_vocab_size(tp_size, make_vocab_size_divisible_by),
            "max_sequence_length": self.max_position_embeddings,
            "position_embedding_type": "rope",
            "rotary_percent": self.partial_rotary_factor,
            "rotary_base": self.rope_theta,
            "share_embeddings_and_output_weights": self.tie_word_embeddings and head == "lm",
        }
        if self.llama3_rope_factor is not None:
            kwargs.update(rope_scaling=True, rope_scaling_factor=self.llama3_rope_factor)
        return kwargs


def _required(hf_config: Mapping[str, Any], key: str) -> Any:
    if key not in hf_config:
        raise ValueError(f"HF config has no {key!r}")
    return hf_config[key]


def _reject_true(hf_config: Mapping[str, Any], key: str) -> None:
    if hf_config.get(key):
        raise ValueError(
            f"{key}=true is not supported for model_type {hf_config.get('model_type')!r} "
            "(the Megatron model would compute something else)"
        )


def _read_moe(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The MoE fields of a Qwen3-MoE config; ValueError for the layer patterns not built."""
    if hf_config.get("mlp_only_layers"):
        raise ValueError(
            f"mlp_only_layers={hf_config['mlp_only_layers']} (dense MLP layers among the MoE "
            "layers) is not supported: every layer must be an MoE; set mlp_only_layers=[]"
        )
    if hf_config.get("decoder_sparse_step", 1) != 1:
        raise ValueError(
            f"decoder_sparse_step={hf_config['decoder_sparse_step']} (an MoE every k-th layer) "
            "is not supported: every layer must be an MoE; set decoder_sparse_step=1"
        )
    if hf_config.get("shared_expert_intermediate_size"):
        raise ValueError("shared experts are not supported (Qwen3-MoE has none)")
    # transformers 5.x writes num_local_experts; the published configs (4.x) num_experts.
    num_experts = hf_config.get("num_experts", hf_config.get("num_local_experts"))
    if not num_experts:
        raise ValueError("HF config has no 'num_experts' (or 'num_local_experts')")
    top_k = _required(hf_config, "num_experts_per_tok")
    if not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
    return {
        "num_experts": num_experts,
        "moe_top_k": top_k,
        "moe_intermediate_size": _required(hf_config, "moe_intermediate_size"),
        # transformers' Qwen3MoeConfig default is False; every published checkpoint sets true.
        "norm_topk_prob": bool(hf_config.get("norm_topk_prob", False)),
    }


def _read_rope(hf_config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """rope_theta, the llama3 factor (or None), partial_rotary_factor and the YaRN fields
    (``yarn``, megatron's MLA names; empty: none) from either config dialect."""
    params = dict(hf_config.get("rope_scaling") or {})  # transformers 4.x
    params.update(hf_config.get("rope_parameters") or {})  # transformers 5.x
    theta = float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    partial = float(
        params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
    )
    if partial != 1.0 and model_type != "glm4_moe":
        raise ValueError(f"partial_rotary_factor={partial} is supported for glm4_moe only; need 1")
    if not 0.0 < partial <= 1.0:
        raise ValueError(f"partial_rotary_factor={partial} must be in (0, 1]")
    out: dict[str, Any] = {
        "rope_theta": theta, "llama3_rope_factor": None, "partial_rotary_factor": partial,
        "yarn": (),
    }  # fmt: skip
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return out
    if rope_type == "yarn" and model_type == "deepseek_v3":
        return out | {"yarn": _read_yarn(params)}
    if rope_type != "llama3":
        raise ValueError(
            f"rope_type {rope_type!r} is not supported for {model_type!r}; supported: default, "
            "llama3, and yarn for deepseek_v3"
        )
    fixed = {key: params.get(key) for key in _MEGATRON_LLAMA3_ROPE}
    if fixed != _MEGATRON_LLAMA3_ROPE:
        raise ValueError(
            f"llama3 RoPE scaling with {fixed} is not supported: megatron-core fixes "
            f"{_MEGATRON_LLAMA3_ROPE} (only 'factor' may vary)"
        )
    return out | {"llama3_rope_factor": float(params["factor"])}


def _read_yarn(params: Mapping[str, Any]) -> tuple[tuple[str, float], ...]:
    """DeepSeek-V3's YaRN as megatron's ``MLATransformerConfig`` fields. transformers'
    ``_compute_yarn_parameters`` and megatron's ``YarnRotaryEmbedding`` agree on the
    frequencies and the cos/sin factor mscale(f, mscale) / mscale(f, mscale_all_dim); both
    scale the softmax by mscale(f, mscale_all_dim)^2 (``yarn_apply_mscale``,
    ``MLASelfAttention``). ``truncate`` false (no rounding of the correction range) has no
    megatron counterpart."""
    if params.get("truncate", True) is not True:
        raise ValueError("yarn with truncate=false is not supported: megatron rounds the range")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in params:
            raise ValueError(f"yarn rope_parameters have no {key!r}")
    return (
        ("rotary_scaling_factor", float(params["factor"])),
        ("original_max_position_embeddings", int(params["original_max_position_embeddings"])),
        ("beta_fast", float(params.get("beta_fast") or 32.0)),
        ("beta_slow", float(params.get("beta_slow") or 1.0)),
        ("mscale", float(params.get("mscale") or 1.0)),
        ("mscale_all_dim", float(params.get("mscale_all_dim") or 0.0)),
    )


def _read_mla(hf_config: Mapping[str, Any], yarn: tuple[tuple[str, float], ...]) -> MLAShape:
    """DeepSeek-V3's latent attention. RoPE: transformers with ``rope_interleave`` (its
    default, every published checkpoint) de-interleaves the rotary dims and rotates halves,
    which is what megatron's MLA does (``rope_utils._apply_rotary_pos_emb_bshd`` with
    ``multi_latent_attention``); false would need the rotary rows permuted: refused."""
    if hf_config.get("rope_interleave", True) is not True:
        raise ValueError(
            "rope_interleave=false is not supported for deepseek_v3: megatron's MLA rotates "
            "de-interleaved dims (every published DeepSeek-V3 checkpoint sets true)"
        )
    heads = _required(hf_config, "num_attention_heads")
    if (hf_config.get("num_key_value_heads") or heads) != heads:
        raise ValueError(
            f"num_key_value_heads={hf_config['num_key_value_heads']} != num_attention_heads="
            f"{heads}: MLA has one key/value per head"
        )
    return MLAShape(
        q_lora_rank=hf_config.get("q_lora_rank"),
        kv_lora_rank=_required(hf_config, "kv_lora_rank"),
        qk_nope_head_dim=_required(hf_config, "qk_nope_head_dim"),
        qk_rope_head_dim=_required(hf_config, "qk_rope_head_dim"),
        v_head_dim=_required(hf_config, "v_head_dim"),
        yarn=yarn,
    )


def _check_supported(hf_config: Mapping[str, Any]) -> str:
    """The model_type; ValueError for a type, architecture or option not built."""
    model_type = FAMILY_ALIASES.get(hf_config.get("model_type"), hf_config.get("model_type"))
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported: "
            f"{sorted(SUPPORTED_ARCHITECTURES) + sorted(FAMILY_ALIASES)}"
        )
    accepted = SUPPORTED_ARCHITECTURES[model_type]
    for arch in hf_config.get("architectures") or ():
        if arch not in accepted:
            raise ValueError(
                f"architecture {arch!r} is not supported for model_type {model_type!r}; "
                f"supported: {list(accepted)}"
            )
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf_config['hidden_act']!r} is not supported; need 'silu'")
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        _reject_true(hf_config, "use_sliding_window")
    if model_type not in ("qwen2", "glm4_moe"):
        _reject_true(hf_config, "attention_bias")
    windowed = sorted({t for t in hf_config.get("layer_types") or () if t != "full_attention"})
    if windowed:
        raise ValueError(f"layer_types {windowed} are not supported; need full_attention")
    if model_type == "llama":
        _reject_true(hf_config, "mlp_bias")
    return model_type


def _read_sigmoid_moe(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The MoE of a DeepSeek-V3 or GLM-4.5 config (``deepseek_v3``/``glm4_moe`` modeling:
    ``...TopkRouter`` and ``...MoE.route_tokens_to_experts``): sigmoid scores, top-k of
    scores + ``e_score_correction_bias`` inside the best ``topk_group`` of ``n_group`` groups
    (a group's score: the sum of its top 2), weights the unbiased scores of the chosen
    experts, renormalised (``norm_topk_prob``), times ``routed_scaling_factor``; shared
    experts beside; the first ``first_k_dense_replace`` layers dense.

    megatron-core 0.16.1 always renormalises sigmoid weights when top_k > 1
    (``topk_routing_with_score_function``), and scores a group by the sum of its top
    ``topk // group_topk`` (``group_limited_topk``): refused where either differs."""
    for key, want in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        if hf_config.get(key, want) != want:
            raise ValueError(f"{key}={hf_config[key]!r} is not supported; need {want!r}")
    if not hf_config.get("norm_topk_prob", True):
        raise ValueError(
            "norm_topk_prob=false is not supported: megatron renormalises sigmoid weights"
        )
    num_experts = _required(hf_config, "n_routed_experts")
    top_k = _required(hf_config, "num_experts_per_tok")
    layers = _required(hf_config, "num_hidden_layers")
    first_dense = int(hf_config.get("first_k_dense_replace") or 0)
    if not 0 < top_k <= num_experts or not 0 <= first_dense < layers:
        raise ValueError(
            f"num_experts_per_tok={top_k} must be in [1, n_routed_experts={num_experts}] and "
            f"first_k_dense_replace={first_dense} in [0, num_hidden_layers={layers})"
        )
    groups = int(hf_config.get("n_group") or 1)
    group_topk = int(hf_config.get("topk_group") or 1)
    if groups > 1 and (num_experts % groups or top_k % group_topk or top_k // group_topk != 2):
        raise ValueError(
            f"n_group={groups}, topk_group={group_topk}, num_experts_per_tok={top_k}: "
            "transformers scores a group by its top 2 experts, megatron by its top "
            "num_experts_per_tok // topk_group; they agree only when that is 2 (and n_group "
            "divides n_routed_experts); set n_group=1 or choose sizes with ratio 2"
        )
    return {
        "num_experts": num_experts,
        "moe_top_k": top_k,
        "moe_intermediate_size": _required(hf_config, "moe_intermediate_size"),
        "norm_topk_prob": True,
        "router_score": "sigmoid",
        "moe_num_groups": groups,
        "moe_group_topk": group_topk if groups > 1 else 1,
        "routed_scaling_factor": float(hf_config.get("routed_scaling_factor") or 1.0),
        "num_shared_experts": int(hf_config.get("n_shared_experts") or 0),
        "first_k_dense": first_dense,
        "mtp_num_layers": int(hf_config.get("num_nextn_predict_layers") or 0),
    }


def _read_dtype(hf_config: Mapping[str, Any]) -> torch.dtype:
    name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; supported: {sorted(_DTYPES)}")
    return _DTYPES[name]
