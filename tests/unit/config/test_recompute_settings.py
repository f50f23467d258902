"""Recompute settings: read from a recipe per model, passed to megatron's TransformerConfig."""

import pytest

from tests.distributed.step.workers.train_step_worker import HF_CONFIG
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.recipe import load_recipe
from vapo_megatron.config.recompute import RecomputeSettings
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.models.provider import transformer_config

pytestmark = pytest.mark.unit


def test_recipe_sets_each_model_and_transformer_config_gets_it():
    config = load_recipe(
        "recipes/tiny_cpu.yaml",
        ["policy.recompute.granularity=full", "policy.recompute.method=uniform",
         "policy.recompute.num_layers=2", "critic.recompute.granularity=selective"],
    )  # fmt: skip
    assert config.policy.recompute == RecomputeSettings(
        granularity="full", method="uniform", num_layers=2
    )
    assert config.critic.recompute == RecomputeSettings(granularity="selective")
    hf = HFModelConfig.from_hf(HF_CONFIG.to_dict())
    tc = transformer_config(
        hf, ModelLayout(), recompute=config.policy.recompute.transformer_config_kwargs()
    )
    assert (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers) == (
        "full", "uniform", 2,
    )  # fmt: skip
    assert transformer_config(hf, ModelLayout()).recompute_granularity is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"granularity": "full"}, "granularity=full needs method uniform or block"),
        ({"granularity": "full", "method": "block", "num_layers": -1}, "num_layers must be >= 1"),
        ({"granularity": "selective", "num_layers": 2}, "only apply to granularity=full"),
        ({"method": "uniform"}, "only apply to granularity=full"),
        ({"granularity": "everything"}, "selective, full or null, got 'everything'"),
    ],
)
def test_bad_combinations_name_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RecomputeSettings(**kwargs)
