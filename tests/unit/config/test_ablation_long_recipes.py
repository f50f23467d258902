"""The long-trace Table 1 recipes (issue 29): each row's recipe is what tools/ablate.py runs for
its preset over recipes/ablation_long.yaml, at the paper's values where they fit."""

from __future__ import annotations

import json
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


# Issue 44: the rows on the reward model with the paper's value bias.
UNFINISHED = RECIPES / "ablation_long_unfinished.yaml"
UNFINISHED_FAST = RECIPES / "ablation_long_unfinished_fast_critic.yaml"
BIAS_ROWS = ("vapo", "vapo_without_value_pretraining", "vapo_without_decoupled_gae", "ppo")


def test_unfinished_recipes_are_the_base_with_the_biased_critic_and_its_lr():
    base = load_recipe(BASE)
    paper, fast = load_recipe(UNFINISHED), load_recipe(UNFINISHED_FAST)
    for config in (paper, fast):
        assert Path(config.critic.init_path).name == "reward_model_unfinished"
        assert (REPO_ROOT / config.critic.init_path / "config.json").is_file()
        assert asdict(config.algorithm) == asdict(base.algorithm)
        assert config.policy.optim.lr == base.policy.optim.lr == 3.0e-5
        assert asdict(config.rollout) == asdict(base.rollout)
        assert config.critic.optim.weight_decay == base.critic.optim.weight_decay
    assert paper.critic.optim.lr == pytest.approx(2 * paper.policy.optim.lr)  # the paper's ratio
    assert fast.critic.optim.lr == base.critic.optim.lr == 2.0e-3  # today's


@pytest.mark.parametrize("name", BIAS_ROWS)
@pytest.mark.parametrize("recipe", [UNFINISHED, UNFINISHED_FAST])
def test_the_bias_sweeps_rows_load_and_keep_the_biased_critic(recipe, name):
    config = load_recipe(recipe)
    plan = scaled_algorithm(name, config)
    assert plan.get("critic_init", "reward_model") == "reward_model"  # the reward model is kept
    row = load_recipe(recipe, _algorithm_overrides(plan) + ["critic.optim.lr=1e-4"])
    row.check(2)
    assert row.critic.optim.lr == 1e-4  # tools/ablate.py's overrides reach the critic's lr
    assert row.critic.init_path == config.critic.init_path


def test_the_bias_sweep_script_runs_these_recipes_and_rows():
    script = (REPO_ROOT / "tools" / "ablation_bias_sweep.sh").read_text()
    assert f"--rows {','.join(BIAS_ROWS)}" in script
    for recipe in (UNFINISHED, UNFINISHED_FAST):
        assert str(recipe.relative_to(REPO_ROOT)) in script
    assert '--json "$report"' in script and "tools/ablation_bias_merge.py" in script


def test_the_bias_reports_merge_into_a_row_per_preset_and_setting(tmp_path):
    from tools.ablation_bias_merge import SETTINGS, merge

    (tmp_path / "docs").mkdir()
    for k, setting in enumerate(list(SETTINGS.values())[:2]):
        rows = {preset: {"preset": preset, "finals": [float(k)]} for preset in BIAS_ROWS}
        report = {"rows": rows, "evaluation_movement_shared": {"fraction": 0.5 + k}}
        (tmp_path / setting["report"]).write_text(json.dumps(report))
    merged = merge(tmp_path)
    names = list(SETTINGS)
    assert sorted(merged["rows"]) == sorted(f"{p}@{n}" for p in BIAS_ROWS for n in names[:2])
    assert merged["rows"][f"ppo@{names[1]}"] == {
        "preset": "ppo",
        "finals": [1.0],
        "setting": names[1],
    }
    assert merged["settings"][names[0]]["evaluation_movement_shared"] == {"fraction": 0.5}
    assert merged["missing"] == [SETTINGS[names[2]]["report"]]
