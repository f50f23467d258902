"""A critic's HF tensors, from a policy's or a reward model's: the layout of
``{Qwen2,Llama}ForSequenceClassification`` with one label (the trunk, no ``lm_head``, and
``score.weight`` [1, hidden]), which the name table maps to the critic's value head."""

from __future__ import annotations

import os

import torch

from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.weights import hf_io

VALUE_HEAD = "score.weight"
"""The HF name of the critic's value head (the name table's ``output_layer.weight``)."""


def policy_hf_tensors(model_path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the policy's HF directory; ValueError for a reward/score model."""
    source = hf_io.HFCheckpoint(model_path)
    if VALUE_HEAD in source.names:
        raise ValueError(
            f"model.path={model_path} is a reward/score model (it has {VALUE_HEAD}), not a "
            "policy; point model.path at the policy and critic.init_path at the reward model"
        )
    return dict(source.read(source.names))


def reward_model_hf_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a critic's or reward model's HF directory; ValueError without a value
    head."""
    source = hf_io.HFCheckpoint(path)
    if VALUE_HEAD not in source.names:
        raise ValueError(
            f"{path} has no {VALUE_HEAD}: not a critic or reward model. Give a "
            "*ForSequenceClassification directory or a critic checkpoint (tools/convert.py "
            "hf-to-mcore --critic-from reward-model)"
        )
    return dict(source.read(source.names))


def critic_from_policy(
    policy: dict[str, torch.Tensor], hf: HFModelConfig, std: float, seed: int
) -> dict[str, torch.Tensor]:
    """A critic's HF tensors from a policy's: its trunk, no lm_head, and a new value head
    (``score.weight`` [1, hidden], normal with ``std``, seeded)."""
    tensors = {k: v for k, v in policy.items() if k != "lm_head.weight"}
    generator = torch.Generator().manual_seed(seed)
    head = torch.randn(1, hf.hidden_size, generator=generator, device=HOST) * std
    tensors[VALUE_HEAD] = head.to(next(iter(policy.values())).dtype)
    return tensors
