"""rollout.placement, rollout.ranks, rollout.lag and algorithm.off_policy_correction: what
each accepts, what it refuses and what the message says (issue 42)."""

from __future__ import annotations

import pytest

from tests.launcher import REPO_ROOT
from vapo_megatron.config.recipe import load_recipe

TINY = REPO_ROOT / "recipes" / "tiny_cpu.yaml"
ASYNC = REPO_ROOT / "recipes" / "tiny_cpu_async.yaml"


def test_the_async_recipe_is_separate_with_lag_1_and_fits_three_ranks():
    config = load_recipe(ASYNC, [])
    rollout = config.rollout
    assert (rollout.placement, rollout.steps_behind, rollout.rollout_world(3)) == ("separate", 1, 1)
    assert config.algorithm.off_policy_correction == "vtrace"
    config.check(3)  # 2 trainer ranks take the policy's TP 2


@pytest.mark.parametrize(
    "overrides,lag,rollout_ranks",
    [([], 0, 0), (["rollout.lag=3"], 3, 0),
     (["rollout.placement=separate", "rollout.ranks=0.25"], 1, 2),
     (["rollout.placement=separate", "rollout.ranks=2", "rollout.lag=0"], 0, 2)],
)  # fmt: skip
def test_lag_defaults_and_rank_counts(overrides, lag, rollout_ranks):
    rollout = load_recipe(TINY, overrides).rollout
    assert rollout.steps_behind == lag
    assert rollout.rollout_world(8) == rollout_ranks


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["rollout.ranks=2"], "set rollout.placement=separate"),
        (["rollout.placement=separate"], "needs rollout.ranks"),
        (["rollout.placement=separate", "rollout.ranks=1.5"], "needs rollout.ranks"),
        (["rollout.lag=-1"], "rollout.lag=-1.*>= 0"),
        (["rollout.placement=elsewhere"], "colocated', 'separate'"),
        (["algorithm.c_bar=2.0"], "c_bar"),
    ],
)
def test_bad_settings_name_the_fix(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_recipe(TINY, overrides)


@pytest.mark.parametrize(
    "overrides,world,match",
    [
        (["rollout.ranks=3"], 3, "at least one rank must generate and one must train"),
        (
            ["rollout.ranks=1", "rollout.tensor_parallel_size=2"],
            4,
            "do not split into vLLM replicas",
        ),
        (["rollout.ranks=2"], 4, "does not divide the 2 trainer ranks|divide the 2 trainer ranks"),
    ],
)
def test_the_split_must_fit_both_sides(overrides, world, match):
    config = load_recipe(TINY, ["rollout.placement=separate", "policy.layout.tp=2",
                                "critic.layout.tp=2", *overrides])  # fmt: skip
    if "trainer ranks" in match:  # policy TP 2 fits 2 trainer ranks: make it not fit
        config = load_recipe(TINY, ["rollout.placement=separate", "policy.layout.tp=4", *overrides])
    with pytest.raises(ValueError, match=match):
        config.check(world)
