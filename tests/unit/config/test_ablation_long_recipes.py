"""The long-trace Table 1 recipes (issue 29): each row's recipe is what tools/ablate.py runs for
its preset over recipes/ablation_long.yaml, at the paper's values where they fit."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.launcher import REPO_ROOT
from vapo_megatron.config.recipe import load_recipe

sys.path.insert(0, str(REPO_ROOT / "tools"))
from ablate import _algorithm_overrides, scaled_algorithm  # noqa: E402

pytestmark = pytest.mark.unit
RECIPES = REPO_ROOT / "recipes"
BASE = RECIPES / "ablation_long.yaml"
ROWS = {
    "vapo": BASE,
    "vapo_without_value_pretraining": RECIPES / "ablation_long_without_value_pretraining.yaml",
    "vapo_without_decoupled_gae": RECIPES / "ablation_long_without_decoupled_gae.yaml",
    "vapo_without_length_adaptive_gae": RECIPES / "ablation_long_without_length_adaptive_gae.yaml",
    "ppo": RECIPES / "ablation_long_ppo.yaml",
    "dapo": RECIPES / "ablation_long_dapo.yaml",
    "grpo": RECIPES / "ablation_long_grpo.yaml",
}


@pytest.mark.parametrize("name", ROWS)
def test_row_recipe_is_the_ablate_plan(name):
    base = load_recipe(BASE)
    planned = load_recipe(BASE, _algorithm_overrides(scaled_algorithm(name, base)))
    row = load_recipe(ROWS[name])
    row.check(2)
    assert asdict(row.algorithm) == asdict(planned.algorithm)
    assert row.samples_per_step == base.samples_per_step == 64


def test_paper_values_and_the_shipped_models():
    config = load_recipe(BASE)
    algo = config.algorithm
    assert (algo.length_adaptive_alpha, algo.lambda_critic) == (0.05, 1.0)
    assert (algo.eps_low, algo.eps_high, algo.positive_nll_coef) == (0.2, 0.28, 0.1)
    assert algo.critic_init == "reward_model" and algo.samples_per_prompt > 1
    assert Path(REPO_ROOT / config.critic.init_path).name == "reward_model"
    assert config.data.train_path.startswith("vapo_megatron/tiny/long/")
    assert not config.model.create_tiny
    ppo = load_recipe(ROWS["ppo"]).algorithm
    assert (ppo.critic_init, ppo.value_pretrain_steps, ppo.samples_per_prompt) == (
        "reward_model",
        0,
        1,
    )
    assert load_recipe(ROWS["vapo_without_value_pretraining"]).algorithm.value_pretrain_steps == 0
