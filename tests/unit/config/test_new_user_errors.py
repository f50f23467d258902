"""What a new user meets on a wrong setting (issue 40): each refusal names the setting, why it
is wrong and what is valid, and no list of valid keys offers a removed setting."""

import logging

import pytest

from tests.launcher import REPO_ROOT
from vapo_megatron.config.checks import check_critic_start, check_layouts_on_models
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.recipe import load_recipe
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.weights import hf_io

pytestmark = pytest.mark.unit
TINY = REPO_ROOT / "recipes" / "tiny_cpu.yaml"
DENSE_MODEL = REPO_ROOT / "vapo_megatron" / "tiny" / "demo" / "model"  # a qwen2


def tiny(*overrides: str):
    return load_recipe(TINY, list(overrides))


def test_valid_trainer_keys_do_not_offer_the_removed_gae_path():
    with pytest.raises(ValueError, match="unknown config key trainer.stepz") as err:
        tiny("trainer.stepz=3")
    assert "valid keys here" in str(err.value) and "gae_path" not in str(err.value)


def test_gae_path_in_a_recipe_still_gets_its_removal_message(caplog):
    for value in ("flat", "shards"):
        with pytest.raises(ValueError, match="trainer.gae_path=.*removed.*delete trainer.gae_path"):
            tiny(f"trainer.gae_path={value}")
    for value in ("auto", "null"):  # earlier runs' resolved configs hold one of these
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vapo_megatron"):
            tiny(f"trainer.gae_path={value}").check(world_size=2)
        assert "trainer.gae_path is deprecated and ignored" in caplog.text


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["rollout.temperature=-1"], r"rollout.temperature=-1.0 is not a temperature: give one > 0"),
        (["rollout.temperature=-1", "algorithm.samples_per_prompt=1", "trainer.mini_batch_size=8"],
         "is not a temperature"),
        (["eval.temperature=-0.5"], r"eval.temperature=-0.5 is not a temperature"),
        (["rollout.temperature=.nan"], "rollout.temperature=nan is not a temperature"),
        (["rollout.top_p=0"], r"rollout.top_p=0.0 must be in \(0, 1\]"),
        (["eval.top_p=1.5"], r"eval.top_p=1.5 must be in \(0, 1\]"),
        (["rollout.temperature=0"], "rollout.temperature=0 is greedy: all 4 samples"),
        (["rollout.temperature=0", "algorithm.samples_per_prompt=1", "trainer.mini_batch_size=8"],
         "the policy's updates need its log-probs at the sampling temperature"),
    ],
)  # fmt: skip
def test_sampling_settings_say_what_is_valid(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny(*overrides).check(world_size=2)


def test_greedy_critic_pretraining_alone_is_accepted():
    tiny("rollout.temperature=0", "algorithm.samples_per_prompt=1", "trainer.mini_batch_size=8",
         "trainer.steps=0").check(world_size=2)  # fmt: skip


def _models(config):
    hf = HFModelConfig.from_hf(hf_io.read_config(DENSE_MODEL))
    return {"policy": (str(DENSE_MODEL), hf), "critic": (str(DENSE_MODEL), hf)}


@pytest.mark.parametrize(
    "override, named",
    [("policy.layout.ep=2", "policy.layout.ep=2"), ("critic.layout.ep=2", "critic.layout.ep=2"),
     ("critic.layout.etp=2", "critic.layout.etp=2"), ("policy.layout.etp=1", "policy.layout.etp=1")],
)  # fmt: skip
def test_expert_parallelism_on_a_dense_model_names_model_family_and_settings(override, named):
    config = tiny(f"model.path={DENSE_MODEL}", override)
    with pytest.raises(ValueError) as err:
        check_layouts_on_models(config, _models(config), world_size=2)
    text = str(err.value)
    role = override.split(".")[0]
    assert text.startswith(f"{named}: expert parallelism needs a mixture-of-experts model")
    assert f"{DENSE_MODEL} is a dense qwen2 model (no experts)" in text
    assert f"Drop {role}.layout.ep and {role}.layout.etp from the recipe" in text
    assert "does not divide" not in text  # not the expert groups' arithmetic


def test_layouts_on_models_pass_and_still_do_the_expert_arithmetic():
    config = tiny(f"model.path={DENSE_MODEL}")
    check_layouts_on_models(config, _models(config), world_size=2)
    check_layouts_on_models(config, {}, world_size=2)  # models not written yet: arithmetic only
    moe_layout = tiny("policy.layout.ep=4")  # model unknown: the world's arithmetic
    with pytest.raises(ValueError, match=r"policy.layout: etp \* ep = 2 \* 4 = 8 does not divide"):
        check_layouts_on_models(moe_layout, {}, world_size=2)
    ModelLayout(tp=2).check(_models(config)["policy"][1])  # a dense model at tp 2 is fine


def test_critic_start_hints_give_the_accepted_critic_init_values(tmp_path):
    no_path = tiny("algorithm.critic_init=reward_model")
    with pytest.raises(ValueError) as err:
        no_path.check(world_size=2)
    assert "algorithm.critic_init takes policy or reward_model" in str(err.value)
    missing = tiny("algorithm.critic_init=reward_model", f"critic.init_path={tmp_path / 'rm'}")
    with pytest.raises(ValueError) as err:
        check_critic_start(missing)
    text = str(err.value)
    assert "--critic-from reward-model` with algorithm.critic_init=reward_model;" in text
    assert "algorithm.critic_init takes policy or reward_model" in text
    with pytest.raises(ValueError, match=r"must be one of \['policy', 'reward_model'\]"):
        tiny("algorithm.critic_init=reward")
