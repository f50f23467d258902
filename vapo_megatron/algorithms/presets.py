"""Named algorithm configs: VAPO, its ablations and the baselines it is compared with.

A preset is data: a set of AlgoConfig field values. ``vapo_without_<change>`` switches off one
of VAPO's seven changes and keeps the other six, as in the paper's ablation table.
"""

from __future__ import annotations

from dataclasses import replace

from vapo_megatron.algorithms.config import AlgoConfig

# The AlgoConfig defaults are the paper's values; critic_init is spelled out because the
# paper's value pretraining starts the critic from the reward model.
VAPO: dict = {"critic_init": "reward_model"}

# What switching off each change means (one row each in the paper's ablation table).
VAPO_CHANGES_OFF: dict[str, dict] = {
    "value_pretraining": {"value_pretrain_steps": 0},
    "decoupled_gae": {"decoupled_gae": False},
    "length_adaptive_gae": {"length_adaptive_alpha": None, "lambda_policy": 0.95},
    "token_level_loss": {"loss_aggregation": "seq-mean-token-mean"},
    "clip_higher": {"eps_high": 0.2},
    "positive_lm_loss": {"positive_nll_coef": 0.0},
    # Same number of samples per step (8192), as vanilla PPO draws them: one per prompt.
    "group_sampling": {"prompts_per_step": 8192, "samples_per_prompt": 1},
}

_PPO = {
    "value_pretrain_steps": 0,
    "lambda_policy": 0.95,
    "length_adaptive_alpha": None,
    "decoupled_gae": False,
    "loss_aggregation": "seq-mean-token-mean",
    "eps_low": 0.2,
    "eps_high": 0.2,
    "positive_nll_coef": 0.0,
    # The paper's PPO baselines sample 8192 prompts x 1 response per step.
    "prompts_per_step": 8192,
    "samples_per_prompt": 1,
}
_GROUP = {
    "advantage_estimator": "group",
    "value_pretrain_steps": 0,
    "length_adaptive_alpha": None,
    "positive_nll_coef": 0.0,
}

PRESETS: dict[str, dict] = {
    # VAPO: all seven changes; the critic starts from the reward model and is warmed up for
    # 50 steps on the frozen policy's returns before policy updates.
    "vapo": VAPO,
    # Vanilla PPO: one lambda = 0.95, sample-level loss, symmetric clip 0.2; the critic starts
    # from the reward model (no value pretraining).
    "ppo": {**_PPO, "critic_init": "reward_model"},
    # VC-PPO: value pretraining (critic from the reward model, 50 steps) and lambda_critic = 1,
    # policy lambda 0.95.
    "vc_ppo": {
        **_PPO,
        "critic_init": "reward_model",
        "value_pretrain_steps": 50,
        "decoupled_gae": True,
        "lambda_critic": 1.0,
    },
    # Open-Reasoner-Zero style PPO: lambda = gamma = 1; ORZ starts its critic from the policy
    # (base model) checkpoint.
    "orz": {
        **_PPO,
        "critic_init": "policy",
        "lambda_policy": 1.0,
        "lambda_critic": 1.0,
        "gamma": 1.0,
    },
    # GRPO and DAPO have no critic: critic_init is unused.
    "grpo": {**_GROUP, "loss_aggregation": "seq-mean-token-mean", "eps_low": 0.2, "eps_high": 0.2},
    # DAPO: clip-higher, token-level loss, dynamic sampling, soft overlong punishment.
    "dapo": {
        **_GROUP,
        "loss_aggregation": "token-mean",
        "eps_low": 0.2,
        "eps_high": 0.28,
        "dynamic_sampling": True,
        "overlong_buffer_len": 4096,
    },
}
PRESETS.update(
    {f"vapo_without_{change}": {**VAPO, **off} for change, off in VAPO_CHANGES_OFF.items()}
)


def algo_preset(name: str, **overrides) -> AlgoConfig:
    """The AlgoConfig of preset ``name``, with field overrides applied on top."""
    if name not in PRESETS:
        raise ValueError(f"unknown algorithm preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(AlgoConfig(**PRESETS[name]), **overrides)
