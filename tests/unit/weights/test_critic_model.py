"""The critic's own model (critic.model, weights/critic.py): which config it reads, what must
match the policy (tokenizer, vocabulary, context) and what the recipe refuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.launcher import REPO_ROOT
from vapo_megatron.config.recipe import load_recipe
from vapo_megatron.config.train import TrainConfig
from vapo_megatron.weights.critic import (
    check_critic_model,
    check_reward_model_fits,
    critic_model_config,
    critic_model_path,
)

pytestmark = pytest.mark.unit
TINY = REPO_ROOT / "recipes" / "tiny_cpu.yaml"
SHIPPED = REPO_ROOT / "vapo_megatron" / "tiny" / "demo" / "model"


def model_dir(path: Path, **changes) -> Path:
    """The shipped tiny policy's config and tokenizer (no weights), with ``changes``."""
    path.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(SHIPPED / name, path / name)
    config = json.loads((SHIPPED / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    return path


def recipe(tmp_path: Path, *overrides: str) -> TrainConfig:
    policy = tmp_path / "policy"
    if not policy.exists():
        model_dir(policy)
    return load_recipe(TINY, [f"model.path={policy}", *overrides])


def small(tmp_path: Path, **changes) -> Path:
    return model_dir(tmp_path / "critic", num_hidden_layers=1, hidden_size=64, **changes)


def test_default_is_the_policys_model_and_a_smaller_one_is_read_from_its_directory(tmp_path):
    same = recipe(tmp_path)
    assert critic_model_path(same) == str(tmp_path / "policy")
    assert critic_model_config(same).hidden_size == 128
    own = recipe(tmp_path, f"critic.model={small(tmp_path)}", "algorithm.critic_init=reward_model")
    hf = critic_model_config(own)
    assert (hf.num_layers, hf.hidden_size) == (1, 64)
    check_critic_model(own)  # same tokenizer, vocabulary and context: nothing to refuse
    own.check(2)


def test_a_preset_serves_the_planner_only(tmp_path):
    config = recipe(tmp_path, "critic.model=qwen2.5-7b", "algorithm.critic_init=reward_model")
    presets = {"qwen2.5-7b": json.loads((SHIPPED / "config.json").read_text())}
    assert critic_model_config(config, presets).num_layers == 2
    with pytest.raises(ValueError) as err:
        critic_model_config(config)
    assert "critic.model=qwen2.5-7b is not an HF model directory" in str(err.value)
    assert "planner preset name serves only tools/plan.py and vapo-train --dry-run" in str(
        err.value
    )


def test_a_critic_with_another_tokenizer_is_refused_naming_what_differs(tmp_path):
    critic = small(tmp_path)
    spec = json.loads((critic / "tokenizer.json").read_text())
    spec["added_tokens"].append({"id": 400, "content": "<|im_end|>", "special": True})
    (critic / "tokenizer.json").write_text(json.dumps(spec))
    config = recipe(tmp_path, f"critic.model={critic}", "algorithm.critic_init=reward_model")
    with pytest.raises(ValueError) as err:
        check_critic_model(config)
    assert f"the critic's model {critic} has another tokenizer" in str(err.value)
    assert "400: ('<|im_end|>', True)" in str(err.value)


def test_a_critic_whose_context_is_too_short_is_refused(tmp_path):
    critic = small(tmp_path, max_position_embeddings=200)  # the recipe's 128 + 96 = 224
    config = recipe(tmp_path, f"critic.model={critic}", "algorithm.critic_init=reward_model")
    with pytest.raises(ValueError) as err:
        check_critic_model(config)
    text = str(err.value)
    assert f"the critic's model {critic} has max_position_embeddings=200" in text
    assert "data.max_prompt_tokens (128) + rollout.max_new_tokens (96) = 224" in text
    shorter = recipe(tmp_path, f"critic.model={critic}", "algorithm.critic_init=reward_model",
                     "rollout.max_new_tokens=72")  # fmt: skip
    check_critic_model(shorter)


def test_a_critic_with_fewer_vocabulary_rows_than_the_policy_is_refused(tmp_path):
    rows = json.loads((SHIPPED / "config.json").read_text())["vocab_size"]
    critic = small(tmp_path, vocab_size=rows - 1)
    config = recipe(tmp_path, f"critic.model={critic}", "algorithm.critic_init=reward_model")
    with pytest.raises(ValueError, match=f"vocab_size={rows - 1}, fewer rows than the policy's"):
        check_critic_model(config)


def test_critic_init_policy_is_refused_for_another_model_and_kept_for_the_policys(tmp_path):
    critic = small(tmp_path)
    with pytest.raises(ValueError) as err:
        recipe(tmp_path, f"critic.model={critic}", "algorithm.critic_init=policy").check(2)
    assert "a value head on another model's trunk cannot start from the policy's weights" in str(
        err.value
    )
    recipe(tmp_path, f"critic.model={tmp_path / 'policy'}", "algorithm.critic_init=policy").check(2)
    # critic_init=reward_model: critic.model is where the weights come from.
    recipe(tmp_path, f"critic.model={critic}", "algorithm.critic_init=reward_model").check(2)
    with pytest.raises(ValueError, match="needs critic.init_path .* or critic.model"):
        recipe(tmp_path, "algorithm.critic_init=reward_model").check(2)
    with pytest.raises(ValueError, match="critic.create_tiny writes a tiny reward model"):
        recipe(tmp_path, "critic.create_tiny=true").check(2)


def test_a_reward_model_of_another_size_than_the_critics_is_refused(tmp_path):
    critic = small(tmp_path)
    with pytest.raises(ValueError) as err:
        check_reward_model_fits(critic, critic_model_config(recipe(tmp_path)), "POLICY")
    text = str(err.value)
    assert "is another model than the critic's (POLICY): num_layers: 1 != 2" in text
    assert f"Set critic.model={critic}" in text
