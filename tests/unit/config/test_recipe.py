"""Recipes -> TrainConfig: every shipped recipe resolves and validates at its world size;
base inheritance, overrides, strict keys and the impossible-combination errors."""

import dataclasses
import re
import types
import typing
from pathlib import Path

import pytest
import yaml

from vapo_megatron.algorithms.presets import PRESETS
from vapo_megatron.config.recipe import config_from_dict, config_to_dict, dump_config, load_recipe
from vapo_megatron.config.train import TrainConfig

pytestmark = pytest.mark.unit
RECIPES = Path(__file__).resolve().parents[3] / "recipes"
# World sizes each recipe is written for: the paper's 16 x 8 H100, one node, the laptop.
WORLD = {
    "vapo_qwen2.5_7b.yaml": 8, "tiny_cpu.yaml": 2, "vapo.yaml": None,
    # The separate placement: its rollout.ranks generate, the rest must fit the layouts.
    "tiny_cpu_async.yaml": 3, "vapo_qwen3_235b_a22b_async.yaml": 256,
}  # fmt: skip


def minimal(**sections):
    data = {"model": {"path": "m"}, "data": {"train_path": "t.jsonl"}}
    for name, value in sections.items():
        data.setdefault(name, {}).update(value)
    return data


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_resolves_and_validates(path):
    world = WORLD.get(path.name, 128)
    if world is None:  # the base recipe has no model: it is only ever extended
        assert "model" not in yaml.safe_load(path.read_text())
        return
    config = load_recipe(path)
    config.check(world)
    assert config.samples_per_step % config.trainer.mini_batch_size == 0


def test_paper_recipe_values():
    config = load_recipe(RECIPES / "vapo_qwen2.5_32b.yaml")
    algo = config.algorithm
    assert (algo.prompts_per_step, algo.samples_per_prompt) == (512, 16)
    assert config.trainer.mini_batch_size == 512
    assert (config.policy.optim.lr, config.critic.optim.lr) == (1e-6, 2e-6)
    assert (algo.eps_low, algo.eps_high, algo.positive_nll_coef) == (0.2, 0.28, 0.1)
    assert (algo.length_adaptive_alpha, algo.lambda_critic, algo.value_pretrain_steps) == (
        0.05,
        1.0,
        50,
    )
    assert algo.critic_init == "reward_model" and config.critic.init_path
    assert (config.eval.k, config.eval.top_p, config.eval.temperature) == (32, 0.7, 1.0)


@pytest.mark.parametrize(
    "name, preset",
    [("ppo.yaml", "ppo"), ("grpo.yaml", "grpo"), ("vapo_without_clip_higher.yaml", None)],
)
def test_ablation_recipes_are_a_preset_over_the_paper_recipe(name, preset):
    config = load_recipe(RECIPES / name)
    expected = PRESETS[preset or "vapo_without_clip_higher"]
    for key, value in expected.items():
        assert getattr(config.algorithm, key) == value, key
    assert config.policy.layout == load_recipe(RECIPES / "vapo_qwen2.5_32b.yaml").policy.layout


def test_base_and_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text(
        yaml.safe_dump(minimal(trainer={"steps": 7, "seed": 3}, policy={"layout": {"tp": 2}}))
    )
    (tmp_path / "child.yaml").write_text("base: base.yaml\ntrainer: {steps: 9}\n")
    config = load_recipe(
        tmp_path / "child.yaml",
        ["policy.layout.pp=2", "eval.max_prompts=null", "rollout.top_p=0.5"],
    )
    assert (config.trainer.steps, config.trainer.seed) == (9, 3)  # merged, not replaced
    assert (config.policy.layout.tp, config.policy.layout.pp) == (2, 2)
    assert config.eval.max_prompts is None and config.rollout.top_p == 0.5
    # YAML 1.1 reads 1e-3 as a string; a float field takes it as the number.
    assert load_recipe(tmp_path / "child.yaml", ["critic.optim.lr=1e-3"]).critic.optim.lr == 1e-3


def test_resolved_config_round_trips(tmp_path):
    config = load_recipe(RECIPES / "tiny_cpu.yaml")
    dump_config(config, tmp_path / "config.yaml")
    again = config_from_dict(yaml.safe_load((tmp_path / "config.yaml").read_text()))
    assert again == config
    assert config_to_dict(again)["algorithm"]["critic_init"] == "policy"


@pytest.mark.parametrize(
    "data, message",
    [
        (minimal(trainer={"step": 3}), "trainer.step; did you mean trainer.steps"),
        (minimal(policy={"layuot": {}}), "did you mean policy.layout"),
        (minimal(trainer={"steps": "ten"}), "trainer.steps must be an integer"),
        (minimal(trainer={"resume": "maybe"}), "trainer.resume='maybe' must be one of"),
        (minimal(algorithm={"preset": "vapoo"}), "algorithm.preset='vapoo' is not a preset"),
        (minimal(algorithm={"eps_hihg": 0.3}), "did you mean algorithm.eps_high"),
        ({"data": {"train_path": "t"}}, "missing required config keys: model"),
        (minimal(algorithm={"lambda_policy": 2.0}), "lambda_policy must lie in [0, 1]"),
    ],
)
def test_bad_keys_and_values_name_the_fix(data, message):
    with pytest.raises(ValueError) as err:
        config_from_dict(data)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "data, world, message",
    [
        (minimal(policy={"layout": {"tp": 4}}), 2, "policy.layout needs tp * pp * cp = 4"),
        (minimal(critic={"layout": {"pp": 3}}, algorithm={"critic_init": "policy"}), 4, "critic"),
        (minimal(trainer={"mini_batch_size": 100}), 1, "mini_batch_size=100 must divide"),
        (minimal(), 1, "critic_init=reward_model needs critic.init_path"),
        (
            minimal(algorithm={"critic_init": "policy"}, rollout={"max_new_tokens": 4000}),
            1,
            "exceeds rollout.max_model_len",
        ),
        (
            minimal(algorithm={"critic_init": "policy"}, rollout={"temperature": 0.0}),
            1,
            "is greedy",
        ),
        (minimal(algorithm={"critic_init": "policy"}, eval={"every": 5}), 1, "need data.eval_path"),
        (
            minimal(algorithm={"preset": "dapo"}, rollout={"max_new_tokens": 1024}),
            1,
            "overlong_buffer_len=4096 exceeds",
        ),
        (
            minimal(algorithm={"critic_init": "policy"}, rollout={"tensor_parallel_size": 3}),
            2,
            "tensor_parallel_size=3 does not divide",
        ),
    ],
)
def test_impossible_combinations(data, world, message):
    with pytest.raises(ValueError) as err:
        config_from_dict(data).check(world)
    assert message in str(err.value)


def test_grpo_needs_no_critic_layout():
    config = config_from_dict(minimal(algorithm={"preset": "grpo"}, critic={"layout": {"tp": 3}}))
    config.check(2)  # the critic's layout is not used without a critic


def integer_fields(cls: type, where: str = "") -> list[str]:
    """Dotted names of every int (or int | None) field of the config tree under ``cls``."""
    found = []
    for name, hint in typing.get_type_hints(cls).items():
        path = f"{where}.{name}" if where else name
        if dataclasses.is_dataclass(hint):
            found += integer_fields(hint, path)
        elif hint is int or (typing.get_origin(hint) is types.UnionType and int in hint.__args__):
            found.append(path)
    return found


INTEGER_FIELDS = integer_fields(TrainConfig)


def test_integer_fields_are_found():
    assert len(INTEGER_FIELDS) >= 30, INTEGER_FIELDS
    for name in ("trainer.checkpoint_every", "algorithm.prompts_per_step", "policy.layout.tp",
                 "critic.optim.lr_warmup_steps", "rollout.kv_cache_bytes", "eval.max_prompts",
                 "policy.recompute.num_layers", "model.tiny_seed"):  # fmt: skip
        assert name in INTEGER_FIELDS


@pytest.mark.parametrize("field", INTEGER_FIELDS)
def test_a_negative_integer_setting_is_refused_with_its_name(field):
    """Every integer setting is a count, size, length or seed: -1 means nothing, and
    ``trainer.checkpoint_every=-3`` used to be accepted and keep no checkpoint."""
    data = minimal(algorithm={"critic_init": "policy"})
    *sections, name = field.split(".")
    node = data
    for section in sections:
        node = node.setdefault(section, {})
    node[name] = -1
    with pytest.raises(ValueError, match=rf"^{re.escape(field)}=-1: a negative value means"):
        config_from_dict(data)


def test_the_refusal_says_what_the_setting_is():
    with pytest.raises(ValueError) as err:
        load_recipe(RECIPES / "tiny_cpu.yaml", ["trainer.checkpoint_every=-3"])
    assert str(err.value) == (
        "trainer.checkpoint_every=-3: a negative value means nothing here "
        "(trainer.checkpoint_every: Save every this many steps (0: only at the end and on "
        "SIGTERM/SIGUSR1)); give one >= 0"
    )
