"""The check's model and data: a tiny Qwen2 with random weights written as an HF directory,
and one step of random prompts, responses and rewards. Nothing is downloaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.step.batching import Ragged, response_offsets
from vapo_megatron.weights import hf_io
from vapo_megatron.weights.record import ModelChunk, ModelRecord

SEED = 1234
HF_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "rope_theta": 1e6,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "initializer_range": 0.02,
    "bos_token_id": None,
    "eos_token_id": 0,
}
MOE_CONFIG = {
    **{k: v for k, v in HF_CONFIG.items() if k not in ("use_sliding_window", "initializer_range")},
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
}
"""The check's tiny Qwen3-MoE: HF_CONFIG's trunk with 8 experts, top 2."""
PROMPTS, SAMPLES_PER_PROMPT = 3, 2
TOKEN_BUDGET = 64
"""Micro-batch token budget: the step's ~130 tokens make several micro-batches."""
OPTIM = OptimSettings(lr=1e-3, weight_decay=0.01, clip_grad=1.0)
"""A large learning rate, so one update visibly moves bf16 weights."""
LOGIT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 8 * 2.0**-7}
"""Allowed max |logit diff| between two implementations, per unit of max(1, max |logit|): fp32
agrees to ~1e-6 on CPU (kernel and reduction order on GPU add a little); bf16 rounds each
activation to 8 bits of mantissa, a few times per layer. A wrong weight mapping or RoPE base
moves logits by a large fraction of their scale."""


@dataclass
class StepData:
    """One step's samples: each prompt repeated SAMPLES_PER_PROMPT times (group sampling),
    random responses and 0/1 rewards, as lists (``score_flat``, ``build_samples``) and as the
    trainer's flat buffers (``Ragged``: the shard path)."""

    prompts: list[list[int]]
    responses: list[list[int]]
    rewards: list[float]

    @property
    def offsets(self) -> torch.Tensor:
        """[S + 1] each response's first token in the flat per-token buffers."""
        return response_offsets([len(r) for r in self.responses])

    @property
    def num_tokens(self) -> int:
        """Response tokens of the step."""
        return sum(len(r) for r in self.responses)

    def ragged(self) -> tuple[Ragged, Ragged]:
        """(prompts, responses) as int32 flat buffers, as ``step/trajectories.Trajectories``."""
        return _ragged(self.prompts), _ragged(self.responses)

    def token_counts(self) -> list[int]:
        """[S] prompt + response tokens of each sample."""
        return [len(p) + len(r) for p, r in zip(self.prompts, self.responses, strict=True)]


def _ragged(rows: list[list[int]]) -> Ragged:
    values = torch.tensor([t for row in rows for t in row], dtype=torch.int32, device=HOST)
    return Ragged(values, response_offsets([len(row) for row in rows]))


def random_step(vocab_size: int) -> StepData:
    gen = torch.Generator(device=HOST).manual_seed(SEED + 1)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab_size, (n,), generator=gen, device=HOST).tolist()

    prompts, responses, rewards = [], [], []
    for p in range(PROMPTS):
        prompt = ids(6 + 3 * p)
        for s in range(SAMPLES_PER_PROMPT):
            prompts.append(prompt)
            responses.append(ids(5 + 7 * p + 4 * s))
            rewards.append(float((p + s) % 2))
    return StepData(prompts, responses, rewards)


def random_hf_tensors(hf: HFModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every HF tensor of the policy, random at a scale that gives logits of order 1 (so the
    logits check has something to compare), on the host as a checkpoint file holds them."""
    record = ModelRecord(hf, "lm")
    gen = torch.Generator(device=HOST).manual_seed(SEED)
    out = {}
    for name in record.hf_names(ModelChunk.whole(hf.num_layers)):
        shape = record.hf_shape(name)
        noise = torch.randn(shape, generator=gen, device=HOST)
        if name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            tensor = 0.1 * noise
        elif name == "model.embed_tokens.weight":
            tensor = noise
        else:  # [out, in] matrices: unit-variance outputs from unit-variance inputs
            tensor = noise / shape[-1] ** 0.5
        out[name] = tensor.to(dtype)
    return out


def write_hf_dir(
    path: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype, config: dict | None = None
) -> None:
    """An HF model directory: ``config`` (default: the tiny Qwen2's) and the tensors."""
    path.mkdir(parents=True)
    config = HF_CONFIG if config is None else config
    hf_io.write_config(path, {**config, "dtype": str(dtype).removeprefix("torch.")})
    writer = hf_io.SafetensorsWriter(path)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    writer.close()
