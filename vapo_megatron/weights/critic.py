"""The critic's model and its HF tensors.

The critic's model is ``critic.model`` (an HF directory, or a planner preset for plan and dry
run), by default the policy's ``model.path``: :func:`critic_hf_config` / :func:`critic_model_config`
are the one place that says which (the session, checkpoints, the critic's export, the planner
and the dry run read it), and :func:`check_critic_model` what must match the policy (the
tokenizer, a vocabulary covering the policy's, a context covering prompt + response).

Its HF tensors, from a policy's or a reward model's, have the layout of
``{Qwen2,Llama}ForSequenceClassification`` with one label (the trunk, no ``lm_head``, and
``score.weight`` [1, hidden]), which the name table maps to the critic's value head."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vapo_megatron.config.checks import check_critic_context
from vapo_megatron.data.tokenizer_match import check_same_tokenizer
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.weights import hf_io

if TYPE_CHECKING:
    from vapo_megatron.config.train import TrainConfig

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


def critic_model_path(config: TrainConfig) -> str:
    """critic.model, or the policy's model.path when it is not set."""
    return config.critic.model or config.model.path


def critic_hf_config(
    config: TrainConfig, presets: Mapping[str, Mapping[str, Any]] | None = None
) -> dict[str, Any]:
    """The critic's HF ``config.json`` as a dict: critic.model's (an HF directory or, where
    ``presets`` is given, as the planner and dry run give theirs, a preset name), else the
    policy's model.path (a planner that plans the policy from a preset, ``--model``, without
    critic.model takes that preset for the critic too). ValueError when critic.model is
    neither, naming the fix."""
    path = critic_model_path(config)
    if presets is not None and config.critic.model in presets:
        return dict(presets[config.critic.model])
    if not (Path(path) / hf_io.CONFIG_NAME).is_file():
        what = "critic.model" if config.critic.model else "model.path"
        raise ValueError(
            f"{what}={path} is not an HF model directory (no {hf_io.CONFIG_NAME}). A planner "
            "preset name serves only tools/plan.py and vapo-train --dry-run; a run needs the "
            "critic's HF directory (its config, tokenizer and, for critic_init=reward_model "
            "without critic.init_path, its weights)"
        )
    return hf_io.read_config(path)


def critic_model_config(
    config: TrainConfig, presets: Mapping[str, Mapping[str, Any]] | None = None
) -> HFModelConfig:
    """The critic's architecture (see :func:`critic_hf_config`)."""
    return HFModelConfig.from_hf(critic_hf_config(config, presets))


def check_critic_model(config: TrainConfig) -> None:
    """ValueError, naming what differs and the fix, when the critic's own model cannot score
    the policy's samples: another tokenizer (``data/tokenizer_match.py``), a vocabulary
    smaller than the policy's (the policy may sample any of its rows), or a context shorter
    than data.max_prompt_tokens + rollout.max_new_tokens. Depth, width, heads and family may
    differ. Nothing to check without a critic."""
    if not (config.algorithm.uses_critic and config.critic.model):
        return
    critic, path = critic_model_config(config), critic_model_path(config)
    check_critic_context(config, critic.max_position_embeddings, path)
    policy = HFModelConfig.from_hf(hf_io.read_config(config.model.path))
    if critic.vocab_size < policy.vocab_size:
        raise ValueError(
            f"critic.model={path} has vocab_size={critic.vocab_size}, fewer rows than the "
            f"policy's {policy.vocab_size} (model.path={config.model.path}): the policy may "
            "sample a token the critic has no embedding for. Choose a critic with the "
            "policy's vocabulary"
        )
    check_same_tokenizer(config.model.path, path)


def model_differences(saved: HFModelConfig, wanted: HFModelConfig) -> list[str]:
    """The architecture fields (not dtype nor init range) in which two models differ."""
    return [
        f"{f.name}: {getattr(saved, f.name)} != {getattr(wanted, f.name)}"
        for f in dataclasses.fields(HFModelConfig)
        if f.name not in ("dtype", "initializer_range")
        and getattr(saved, f.name) != getattr(wanted, f.name)
    ]


def check_reward_model_fits(path: str | os.PathLike, critic: HFModelConfig, model: str) -> None:
    """ValueError when the HF reward model at ``path`` is not the critic's model ``model``
    (critic.model, or the policy's model.path by default)."""
    differ = model_differences(HFModelConfig.from_hf(hf_io.read_config(path)), critic)
    if differ:
        raise ValueError(
            f"{path} is another model than the critic's ({model}): {'; '.join(differ)}. "
            f"Set critic.model={path} to give the critic that reward model's architecture"
        )
