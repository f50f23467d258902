"""What the planner can plan for without a checkpoint on the machine: accelerator types and the
HF configs of published models; and reading the model to plan (a preset or an HF config)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vapo_megatron.models.config import HFModelConfig


@dataclass(frozen=True, kw_only=True)
class GPUSpec:
    """One accelerator type."""

    name: str
    """Preset name."""
    memory_bytes: int
    """Device memory as the driver reports it (nvidia-smi's total)."""
    hbm_bytes_per_s: float
    """Peak memory bandwidth (the datasheet's)."""


GPUS = {
    "h100-80gb": GPUSpec(name="h100-80gb", memory_bytes=81559 << 20, hbm_bytes_per_s=3.35e12),
    "h200-141gb": GPUSpec(name="h200-141gb", memory_bytes=143771 << 20, hbm_bytes_per_s=4.8e12),
}


def _qwen2(**kw: object) -> dict[str, object]:
    base = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064,
            "max_position_embeddings": 32768, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}  # fmt: skip
    return {**base, **kw}


MODEL_PRESETS: dict[str, dict[str, object]] = {
    "qwen2.5-7b": _qwen2(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4),
    "qwen2.5-32b": _qwen2(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                          num_attention_heads=40, num_key_value_heads=8, rms_norm_eps=1e-5),
    "qwen2.5-72b": _qwen2(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, rms_norm_eps=1e-5),
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
