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

Family = Literal["qwen2", "llama", "qwen3", "qwen3_moe"]
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
}

# Fixed inside megatron-core 0.16.1's RotaryEmbedding._apply_scaling.
_MEGATRON_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are mixtures of experts."""
        return self.num_experts > 0

    @classmethod
    def from_hf(cls, hf_config: Mapping[str, Any]) -> HFModelConfig:
        """Read an HF ``config.json`` dict; ``ValueError`` for anything unsupported."""
        model_type = hf_config.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        accepted = SUPPORTED_ARCHITECTURES[model_type]
        for arch in hf_config.get("architectures") or ():
            if arch not in accepted:
                raise ValueError(
                    f"architecture {arch!r} is not supported for model_type {model_type!r}; "
                    f"supported: {list(accepted)}"
                )
        if hf_config.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"hidden_act {hf_config['hidden_act']!r} is not supported; need 'silu'"
            )
        if model_type in ("qwen2", "qwen3", "qwen3_moe"):
            _reject_true(hf_config, "use_sliding_window")
        if model_type != "qwen2":
            _reject_true(hf_config, "attention_bias")
        windowed = sorted({t for t in hf_config.get("layer_types") or () if t != "full_attention"})
        if windowed:
            raise ValueError(f"layer_types {windowed} are not supported; need full_attention")
        if model_type == "llama":
            _reject_true(hf_config, "mlp_bias")

        num_heads = _required(hf_config, "num_attention_heads")
        hidden_size = _required(hf_config, "hidden_size")
        rope_theta, llama3_factor = _read_rope(hf_config)
        return cls(
            family=model_type,
            num_layers=_required(hf_config, "num_hidden_layers"),
            hidden_size=hidden_size,
            num_attention_heads=num_heads,
            num_key_value_heads=hf_config.get("num_key_value_heads") or num_heads,
            head_dim=hf_config.get("head_dim") or hidden_size // num_heads,
            intermediate_size=_required(hf_config, "intermediate_size"),
            vocab_size=_required(hf_config, "vocab_size"),
            max_position_embeddings=_required(hf_config, "max_position_embeddings"),
            rms_norm_eps=float(_required(hf_config, "rms_norm_eps")),
            rope_theta=rope_theta,
            llama3_rope_factor=llama3_factor,
            qkv_bias=model_type == "qwen2",
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            initializer_range=float(hf_config.get("initializer_range", 0.02)),
            dtype=_read_dtype(hf_config),
            qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
            **(_read_moe(hf_config) if model_type == "qwen3_moe" else {}),
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
            "moe_router_score_function": "softmax",
            "moe_router_pre_softmax": not self.norm_topk_prob,
            **(moe or MoESettings()).transformer_config_kwargs(),
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
            "rotary_percent": 1.0,
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
            f"{key}=true is not supported for model_type {hf_config['model_type']!r} "
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


def _read_rope(hf_config: Mapping[str, Any]) -> tuple[float, float | None]:
    """(rope_theta, llama3 factor or None) from either config dialect."""
    params = dict(hf_config.get("rope_scaling") or {})  # transformers 4.x
    params.update(hf_config.get("rope_parameters") or {})  # transformers 5.x
    theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    if params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: default, llama3")
    fixed = {key: params.get(key) for key in _MEGATRON_LLAMA3_ROPE}
    if fixed != _MEGATRON_LLAMA3_ROPE:
        raise ValueError(
            f"llama3 RoPE scaling with {fixed} is not supported: megatron-core fixes "
            f"{_MEGATRON_LLAMA3_ROPE} (only 'factor' may vary)"
        )
    return float(theta), float(params["factor"])


def _read_dtype(hf_config: Mapping[str, Any]) -> torch.dtype:
    name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; supported: {sorted(_DTYPES)}")
    return _DTYPES[name]
