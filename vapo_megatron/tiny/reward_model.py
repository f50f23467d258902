"""``critic.create_tiny``: a tiny reward model for a critic smaller than the tiny policy.

A ``Qwen2ForSequenceClassification`` (one label) with 1 decoder layer and half the policy's
width (hidden 64, 2 heads of 32, intermediate 128: TP 2 splits it), the policy's tokenizer
files copied as they are (so ``data/tokenizer_match.py`` finds them equal), the policy's
vocabulary size and context, and random weights drawn from the seed (transformers' own
initialisation; the score head too). Nothing is downloaded and nothing is trained: it stands
in for a published reward model of another size than the policy, and value pretraining
trains it from there. Built in about a second.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from vapo_megatron.parallel import collectives
from vapo_megatron.weights import hf_io

if TYPE_CHECKING:
    from vapo_megatron.config.train import TrainConfig

logger = logging.getLogger("vapo_megatron")

LAYERS, HIDDEN, HEADS, HEAD_DIM, INTERMEDIATE = 1, 64, 2, 32, 128
"""The tiny reward model's shape: 1 layer, half the tiny policy's width (128)."""


def write_tiny_reward_model(out_dir: str | Path, policy_dir: str | Path, *, seed: int) -> Path:
    """Write the tiny reward model (module docstring) of the policy at ``policy_dir`` to
    ``out_dir``; returns ``out_dir``."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    policy = hf_io.read_config(policy_dir)
    config = Qwen2Config(
        vocab_size=policy["vocab_size"], hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        head_dim=HEAD_DIM, max_position_embeddings=policy["max_position_embeddings"],
        rope_theta=policy.get("rope_theta", 1e6), rms_norm_eps=policy.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=False, num_labels=1, pad_token_id=policy.get("pad_token_id"),
        eos_token_id=policy.get("eos_token_id"), bos_token_id=None, torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    hf_io.copy_assets(policy_dir, out_dir)
    return out_dir


def ensure_tiny_critic(config: TrainConfig, host_group: dist.ProcessGroup) -> None:
    """With critic.create_tiny, rank 0 writes the tiny reward model at critic.model when it is
    missing (after the tiny policy: model.create_tiny); every rank returns once it is there.
    Collective over ``host_group``."""
    if not config.critic.create_tiny:
        return
    out = Path(config.critic.model)
    if dist.get_rank() == 0 and not (out / hf_io.CONFIG_NAME).is_file():
        write_tiny_reward_model(out, config.model.path, seed=config.model.tiny_seed + 1)
        logger.info("tiny reward model written to %s (critic.create_tiny)", out)
    collectives.barrier(host_group)
