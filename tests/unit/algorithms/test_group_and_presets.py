from dataclasses import asdict

import pytest
import torch

from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.algorithms.group_advantages import (
    dynamic_sampling_keep,
    group_normalized_advantages,
    soft_overlong_penalty,
)
from vapo_megatron.algorithms.presets import PRESETS, VAPO_CHANGES_OFF, algo_preset

pytestmark = pytest.mark.unit


def test_group_normalised_advantages():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_normalized_advantages(scores, group_size=4)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()
    torch.testing.assert_close(adv[:4], (torch.tensor([1.0, 0.0, 0.0, 1.0]) - 0.5) / (std + 1e-6))
    assert adv[4:].tolist() == [0.0] * 4
    mean_only = group_normalized_advantages(scores, group_size=4, scale_by_std=False)
    assert mean_only[:4].tolist() == [0.5, -0.5, -0.5, 0.5]
    with pytest.raises(ValueError, match="group_size"):
        group_normalized_advantages(scores, group_size=3)


def test_dynamic_sampling_and_overlong():
    keep = dynamic_sampling_keep(torch.tensor([1, 1, 0, 1, 0, 0]), group_size=2)
    assert keep.tolist() == [False, False, True, True, False, False]
    pen = soft_overlong_penalty(
        torch.tensor([10, 16, 18, 20, 25]), max_response_len=20, buffer_len=4
    )
    assert pen.tolist() == [0.0, 0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="buffer_len"):
        soft_overlong_penalty(torch.tensor([1]), 20, 0)


def test_vapo_preset_is_the_paper():
    cfg = algo_preset("vapo")
    assert (cfg.value_pretrain_steps, cfg.lambda_critic, cfg.length_adaptive_alpha) == (
        50,
        1.0,
        0.05,
    )
    assert (cfg.eps_low, cfg.eps_high, cfg.positive_nll_coef, cfg.gamma) == (0.2, 0.28, 0.1, 1.0)
    assert (cfg.prompts_per_step, cfg.samples_per_prompt, cfg.loss_aggregation) == (
        512,
        16,
        "token-mean",
    )
    assert cfg.decoupled_gae and cfg.uses_critic


@pytest.mark.parametrize("change", sorted(VAPO_CHANGES_OFF))
def test_each_ablation_changes_only_its_fields(change):
    base, ablated = asdict(algo_preset("vapo")), asdict(algo_preset(f"vapo_without_{change}"))
    changed = {k for k in base if base[k] != ablated[k]}
    assert changed and changed <= set(VAPO_CHANGES_OFF[change])


def test_baselines():
    ppo = algo_preset("ppo")
    assert (ppo.lambda_policy, ppo.length_adaptive_alpha, ppo.decoupled_gae) == (0.95, None, False)
    assert (ppo.eps_low, ppo.eps_high, ppo.loss_aggregation) == (0.2, 0.2, "seq-mean-token-mean")
    vc = algo_preset("vc_ppo")
    assert (vc.value_pretrain_steps, vc.lambda_critic, vc.lambda_policy, vc.decoupled_gae) == (
        50,
        1.0,
        0.95,
        True,
    )
    orz = algo_preset("orz")
    assert (orz.lambda_policy, orz.gamma) == (1.0, 1.0)
    assert not algo_preset("grpo").uses_critic and not algo_preset("dapo").uses_critic
    dapo = algo_preset("dapo")
    assert dapo.dynamic_sampling and dapo.overlong_buffer_len and dapo.eps_high == 0.28
    assert len(PRESETS) == 6 + 7


# (prompts_per_step, samples_per_prompt, critic_init) of every preset. The paper: VAPO's group
# sampling is 512 prompts x 16; its PPO baselines take 8192 prompts x 1. Its value pretraining
# (VAPO, VC-PPO) and vanilla PPO start the critic from the reward model; ORZ from the policy.
EXPECTED_BATCH_AND_CRITIC = {
    "vapo": (512, 16, "reward_model"),
    "ppo": (8192, 1, "reward_model"),
    "vc_ppo": (8192, 1, "reward_model"),
    "orz": (8192, 1, "policy"),
    "grpo": (512, 16, None),
    "dapo": (512, 16, None),
    "vapo_without_group_sampling": (8192, 1, "reward_model"),
    **{
        f"vapo_without_{c}": (512, 16, "reward_model")
        for c in VAPO_CHANGES_OFF
        if c != "group_sampling"
    },
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_batch_sizes_and_critic_init(name):
    prompts, samples, critic_init = EXPECTED_BATCH_AND_CRITIC[name]
    cfg = algo_preset(name)
    assert (cfg.prompts_per_step, cfg.samples_per_prompt) == (prompts, samples)
    if cfg.uses_critic:
        assert cfg.critic_init == critic_init
        assert PRESETS[name]["critic_init"] == critic_init  # said by the preset, not a default
    # Same samples per step with and without group sampling.
    assert prompts * samples == 8192


def test_one_sample_per_prompt_still_validates():
    assert algo_preset("ppo").samples_per_prompt == 1
    assert algo_preset("vapo", critic_init="policy").critic_init == "policy"
    with pytest.raises(ValueError, match="samples_per_prompt >= 2"):
        algo_preset("dapo", samples_per_prompt=1)
    with pytest.raises(ValueError, match="dynamic_sampling"):
        algo_preset("ppo", dynamic_sampling=True)
    with pytest.raises(ValueError, match="critic_init"):
        algo_preset("vapo", critic_init="reward-model")


def test_bad_configs_name_the_fix():
    with pytest.raises(ValueError, match="unknown algorithm preset"):
        algo_preset("vapo2")
    with pytest.raises(ValueError, match="lambda_policy"):
        AlgoConfig(lambda_policy=1.5)
    with pytest.raises(ValueError, match="samples_per_prompt >= 2"):
        algo_preset("grpo", samples_per_prompt=1)
    with pytest.raises(ValueError, match="value_pretrain_steps needs a critic"):
        algo_preset("grpo", value_pretrain_steps=5)
    with pytest.raises(ValueError, match="loss_aggregation"):
        algo_preset("vapo", loss_aggregation="sum")
