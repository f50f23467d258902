"""The critic's starting point: a refusal at start that names both ways out."""

import pytest

from tests.launcher import REPO_ROOT
from vapo_megatron.config.checks import check_critic_start
from vapo_megatron.config.recipe import load_recipe

pytestmark = pytest.mark.unit
RECIPE = REPO_ROOT / "recipes" / "vapo_qwen2.5_32b.yaml"


def test_an_absent_reward_model_is_refused_with_both_commands(tmp_path):
    config = load_recipe(RECIPE, [f"critic.init_path={tmp_path / 'rm-tp8'}"])
    with pytest.raises(ValueError) as err:
        check_critic_start(config)
    text = str(err.value)
    assert f"critic.init_path={tmp_path / 'rm-tp8'} does not exist" in text
    assert (
        f"python tools/convert.py hf-to-mcore --tp 8 --pp 1 --hf RM_DIR --out {tmp_path / 'rm-tp8'}"
        " --critic-from reward-model" in text
    )
    assert "--critic-from policy` with algorithm.critic_init=policy critic.init_path=" in text
    assert "algorithm.value_pretrain_steps" in text


def test_nothing_to_refuse(tmp_path):
    (tmp_path / "rm-tp8").mkdir()
    present = load_recipe(RECIPE, [f"critic.init_path={tmp_path / 'rm-tp8'}"])
    check_critic_start(present)
    absent = load_recipe(RECIPE, [f"critic.init_path={tmp_path / 'nope'}"])
    check_critic_start(absent, has_pretrained_critic=True)  # this run's pretrained critic
    check_critic_start(
        load_recipe(RECIPE, ["algorithm.critic_init=policy", "critic.init_path=null"])
    )
    check_critic_start(load_recipe(REPO_ROOT / "recipes" / "grpo.yaml",
                                   [f"critic.init_path={tmp_path / 'nope'}"]))  # fmt: skip
