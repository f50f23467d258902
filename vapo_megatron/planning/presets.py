"""What the planner can plan for without a checkpoint on the machine: accelerator types and the
HF configs of published models; and reading the model to plan (a preset or an HF config)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vapo_megatron.models.config import HFModelConfig

if TYPE_CHECKING:  # only read: planning a recipe needs no config code at import
    from vapo_megatron.config.train import TrainConfig


@dataclass(frozen=True, kw_only=True)
class GPUSpec:
    """One accelerator type."""

    name: str
    """Preset name."""
    memory_bytes: int
    """Device memory as the driver reports it (nvidia-smi's total)."""
    hbm_bytes_per_s: float
    """Peak memory bandwidth (the datasheet's)."""
    bf16_flops: float
    """Peak dense bf16 tensor-core FLOP/s (the datasheet's, without sparsity)."""


GPUS = {
    "h100-80gb": GPUSpec(
        name="h100-80gb", memory_bytes=81559 << 20, hbm_bytes_per_s=3.35e12, bf16_flops=989e12
    ),
    "h200-141gb": GPUSpec(
        name="h200-141gb", memory_bytes=143771 << 20, hbm_bytes_per_s=4.8e12, bf16_flops=989e12
    ),
}


def _qwen2(**kw: object) -> dict[str, object]:
    base = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064,
            "max_position_embeddings": 32768, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}  # fmt: skip
    return {**base, **kw}


def _qwen3(**kw: object) -> dict[str, object]:
    base = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936,
            "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1e6,
            "rms_norm_eps": 1e-6, "attention_bias": False, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16"}  # fmt: skip
    return {**base, **kw}


def _qwen3_moe(**kw: object) -> dict[str, object]:
    moe = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
           "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
           "decoder_sparse_step": 1, "mlp_only_layers": []}  # fmt: skip
    return _qwen3(**moe, **kw)


def _deepseek_v3(**kw: object) -> dict[str, object]:
    base = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
            "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
            "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "n_shared_experts": 1,
            "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
            "topk_method": "noaux_tc", "scoring_func": "sigmoid", "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}  # fmt: skip
    return {**base, **kw}


def _glm4_moe(**kw: object) -> dict[str, object]:
    base = {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"],
            "vocab_size": 151552, "head_dim": 128, "num_attention_heads": 96,
            "num_key_value_heads": 8, "attention_bias": True, "partial_rotary_factor": 0.5,
            "max_position_embeddings": 131072, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
            "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
            "norm_topk_prob": True, "num_nextn_predict_layers": 1,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}  # fmt: skip
    return {**base, **kw}


MODEL_PRESETS: dict[str, dict[str, object]] = {
    "qwen2.5-7b": _qwen2(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4),
    "qwen2.5-32b": _qwen2(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                          num_attention_heads=40, num_key_value_heads=8, rms_norm_eps=1e-5),
    "qwen2.5-72b": _qwen2(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, rms_norm_eps=1e-5),
    # nvidia/AceMath-7B-RM's config.json: Qwen2.5-Math-7B's shapes (those of Qwen2.5-7B) with
    # its 4096-token context and RoPE base 1e4, and a one-label score head.
    "acemath-7b-rm": _qwen2(architectures=["Qwen2ForSequenceClassification"], hidden_size=3584,
                            intermediate_size=18944, num_hidden_layers=28,
                            num_attention_heads=28, num_key_value_heads=4,
                            max_position_embeddings=4096, rope_theta=1e4),
    # The same with its context declared as 32768 tokens (docs/cluster.md, "A 7B critic"): what
    # recipes/vapo_qwen2.5_32b_rm7b.yaml's critic.model holds; positions past 4096 are RoPE
    # extrapolation at base 1e4 that value pretraining has to correct.
    "acemath-7b-rm-32k": _qwen2(architectures=["Qwen2ForSequenceClassification"],
                                hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                num_attention_heads=28, num_key_value_heads=4,
                                max_position_embeddings=32768, rope_theta=1e4),
    # Qwen/Qwen3-32B, Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B config.json (read on the HF Hub
    # through the project's search tool; the MoE values agree with slime's
    # scripts/models/qwen3-*.sh and Megatron-Bridge's Qwen3-MoE recipes).
    "qwen3-32b": _qwen3(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                        num_attention_heads=64, num_key_value_heads=8),
    "qwen3-30b-a3b": _qwen3_moe(hidden_size=2048, intermediate_size=6144,
                                moe_intermediate_size=768, num_hidden_layers=48,
                                num_attention_heads=32, num_key_value_heads=4),
    "qwen3-235b-a22b": _qwen3_moe(hidden_size=4096, intermediate_size=12288,
                                  moe_intermediate_size=1536, num_hidden_layers=94,
                                  num_attention_heads=64, num_key_value_heads=4),
    # deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Instruct, moonshotai/Moonlight-16B-A3B,
    # zai-org/GLM-4.5 and GLM-4.5-Air config.json (published values; the MoE and MLA sizes
    # agree with slime's and Megatron-Bridge's scripts for them). DeepSeek-V3's weights ship in
    # fp8 blocks: bf16 as trained here. Kimi-K2 declares model_type "kimi_k2" with
    # architectures DeepseekV3ForCausalLM (its own modeling file, the same architecture): read
    # as deepseek_v3. Moonlight has no q compression (q_lora_rank null) and no MTP layer.
    # Tokenizers: DeepSeek-V3 129,280 entries; Kimi-K2 and Moonlight one tiktoken vocabulary
    # of 163,840; GLM-4.5 and Air 151,552.
    "deepseek-v3": _deepseek_v3(vocab_size=129280, n_routed_experts=256, n_group=8,
                                topk_group=4, routed_scaling_factor=2.5,
                                num_nextn_predict_layers=1, max_position_embeddings=163840,
                                rope_theta=10000.0,
                                rope_scaling={"type": "yarn", "factor": 40.0, "beta_fast": 32.0,
                                              "beta_slow": 1.0, "mscale": 1.0,
                                              "mscale_all_dim": 1.0,
                                              "original_max_position_embeddings": 4096}),
    "kimi-k2": _deepseek_v3(vocab_size=163840, num_attention_heads=64, num_key_value_heads=64,
                            n_routed_experts=384, n_group=1, topk_group=1,
                            routed_scaling_factor=2.827, first_k_dense_replace=1,
                            num_nextn_predict_layers=0, max_position_embeddings=131072,
                            rope_theta=50000.0,
                            rope_scaling={"type": "yarn", "factor": 32.0, "beta_fast": 1.0,
                                          "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                          "original_max_position_embeddings": 4096}),
    "moonlight-16b-a3b": _deepseek_v3(vocab_size=163840, hidden_size=2048,
                                      intermediate_size=11264, moe_intermediate_size=1408,
                                      num_hidden_layers=27, num_attention_heads=16,
                                      num_key_value_heads=16, q_lora_rank=None,
                                      n_shared_experts=2, n_routed_experts=64,
                                      num_experts_per_tok=6, n_group=1, topk_group=1,
                                      routed_scaling_factor=2.446, first_k_dense_replace=1,
                                      max_position_embeddings=8192, rope_theta=50000.0,
                                      rms_norm_eps=1e-5),
    "glm-4.5": _glm4_moe(hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536,
                         num_hidden_layers=92, n_routed_experts=160, first_k_dense_replace=3,
                         routed_scaling_factor=2.5, use_qk_norm=True),
    "glm-4.5-air": _glm4_moe(hidden_size=4096, intermediate_size=10944,
                             moe_intermediate_size=1408, num_hidden_layers=46,
                             n_routed_experts=128, first_k_dense_replace=1,
                             routed_scaling_factor=1.0, use_qk_norm=False),
    "llama-3.1-70b": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "rope_scaling": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    },
}  # fmt: skip
"""HF config.json values of the published checkpoints (only what the Megatron model reads)."""


def read_model_config(spec: str | None, model_path: str) -> tuple[str, HFModelConfig]:
    """The model to build: a planner preset (``MODEL_PRESETS``), an HF config.json or its
    directory; None: the recipe's model.path."""
    spec = model_path if spec is None else spec
    if spec in MODEL_PRESETS:
        return spec, HFModelConfig.from_hf(MODEL_PRESETS[spec])
    path = Path(spec)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(
            f"model {spec!r} is neither a preset ({', '.join(sorted(MODEL_PRESETS))}) nor an "
            "HF config.json; pass --model PRESET when the checkpoint is not on this machine"
        )
    return str(path), HFModelConfig.from_hf(json.loads(path.read_text()))


def read_critic_config(
    spec: str | None, config: TrainConfig | None
) -> tuple[str, HFModelConfig] | None:
    """The critic's own model: ``spec`` (a preset, an HF config.json or its directory), else
    the recipe's critic.model (``weights/critic.py::critic_model_config``, presets allowed);
    None: the critic is the policy's model."""
    if spec is not None:
        return read_model_config(spec, spec)
    if config is None or not config.critic.model or not config.algorithm.uses_critic:
        return None
    from vapo_megatron.weights.critic import critic_model_config

    return config.critic.model, critic_model_config(config, MODEL_PRESETS)
