"""A critic's HF tensors from a policy's or a reward model's (weights/critic.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vapo_megatron.weights import hf_io
from vapo_megatron.weights.critic import (
    critic_from_policy,
    policy_hf_tensors,
    reward_model_hf_tensors,
)

pytestmark = pytest.mark.unit

HIDDEN = 8


def write_dir(path, tensors: dict[str, torch.Tensor]):
    path.mkdir()
    writer = hf_io.SafetensorsWriter(path)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    writer.close()
    hf_io.write_config(path, {"hidden_size": HIDDEN})
    return path


def policy_tensors(dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": torch.randn(16, HIDDEN).to(dtype),
        "model.norm.weight": torch.ones(HIDDEN, dtype=dtype),
        "lm_head.weight": torch.randn(16, HIDDEN).to(dtype),
    }


def test_critic_keeps_the_trunk_drops_lm_head_and_seeds_a_value_head():
    policy = policy_tensors()
    hf = SimpleNamespace(hidden_size=HIDDEN)
    critic = critic_from_policy(policy, hf, std=0.1, seed=3)
    assert set(critic) == {"model.embed_tokens.weight", "model.norm.weight", "score.weight"}
    assert critic["model.embed_tokens.weight"] is policy["model.embed_tokens.weight"]
    head = critic["score.weight"]
    assert head.shape == (1, HIDDEN) and head.dtype == torch.bfloat16
    assert torch.equal(head, critic_from_policy(policy, hf, std=0.1, seed=3)["score.weight"])
    assert not torch.equal(head, critic_from_policy(policy, hf, std=0.1, seed=4)["score.weight"])
    fp32 = policy_tensors(torch.float32)  # std scales the same draw
    narrow, wide = (critic_from_policy(fp32, hf, std, seed=3)["score.weight"] for std in (0.1, 1))
    torch.testing.assert_close(narrow, wide * 0.1)


def test_policy_read_whole_and_a_score_model_refused(tmp_path):
    policy = policy_tensors(torch.float32)
    read = policy_hf_tensors(write_dir(tmp_path / "policy", policy))
    assert set(read) == set(policy)
    assert all(torch.equal(read[k], policy[k]) for k in policy)
    score = write_dir(tmp_path / "rm", {**policy, "score.weight": torch.zeros(1, HIDDEN)})
    with pytest.raises(ValueError, match="is a reward/score model"):
        policy_hf_tensors(score)
    assert "score.weight" in reward_model_hf_tensors(score)


def test_reward_model_without_a_value_head_refused(tmp_path):
    with pytest.raises(ValueError, match="has no score.weight"):
        reward_model_hf_tensors(write_dir(tmp_path / "policy", policy_tensors(torch.float32)))
