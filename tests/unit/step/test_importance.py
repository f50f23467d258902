"""Stale samples' importance traces (step/importance.py)."""

from __future__ import annotations

import math

import pytest
import torch

from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.step.importance import stale_traces, trace_metrics
from vapo_megatron.step.token_sums import HeldTokens, TokenSums

OFFSETS = torch.tensor([0, 2, 5, 6])  # three samples: 2, 3 and 1 response tokens


def traces(algo=None, staleness=(0, 2, 1)):
    algo = algo or AlgoConfig()
    engine = torch.tensor([-1.0, -2.0, -0.5, -1.5, -3.0, -0.1])
    return stale_traces(algo, engine, torch.tensor(staleness), OFFSETS, monte_carlo=False)


def test_fresh_samples_get_one_and_stale_ones_pi_old_over_mu():
    t = traces()
    policy = torch.tensor([-1.5, -2.5, -0.5, -0.5, -3.5, -0.2])
    ratios = t.ratios_at(torch.arange(6), policy)
    expected = [1.0, 1.0, 1.0, math.e, math.exp(-0.5), math.exp(-0.1)]
    torch.testing.assert_close(ratios, torch.tensor(expected))
    assert ratios.dtype == torch.float32
    # The same from the gathered log-probs (the routed path), at any positions.
    t.policy_logprobs = policy
    torch.testing.assert_close(t.ratios_at(torch.tensor([3, 0])), torch.tensor([math.e, 1.0]))
    held = HeldTokens(ids=torch.tensor([1, 2]), start=[0, 0, 3], num_tokens=4)
    torch.testing.assert_close(t.held_ratios(held, OFFSETS, None), ratios[2:])


@pytest.mark.parametrize(
    "algo,staleness,monte_carlo",
    [
        (AlgoConfig(), (0, 0, 0), False),
        (AlgoConfig(), (0, 2, 1), True),
        (
            AlgoConfig(advantage_estimator="group", samples_per_prompt=2, value_pretrain_steps=0),
            (0, 2, 1),
            False,
        ),
    ],
)
def test_todays_gae_without_correction_or_stale_samples(algo, staleness, monte_carlo):
    engine = torch.zeros(6)
    out = stale_traces(algo, engine, torch.tensor(staleness), OFFSETS, monte_carlo=monte_carlo)
    assert out is None
    assert stale_traces(AlgoConfig(), engine, None, OFFSETS, monte_carlo=False) is None


def test_the_metrics_count_stale_tokens_once():
    t = traces(AlgoConfig(rho_bar=1.0, c_bar=1.0))
    policy = torch.tensor([-1.5, -2.5, -0.5, 0.5, -3.5, -0.2])  # r: -, -, 1, e^2, e^-.5, e^-.1
    held = HeldTokens(ids=torch.tensor([0, 1, 2]), start=[0, 2, 5], num_tokens=6)
    metrics = trace_metrics(t, held, policy, TokenSums(None, None), OFFSETS)
    r = [1.0, math.exp(2), math.exp(-0.5), math.exp(-0.1)]
    assert metrics["offpolicy/stale_token_frac"] == pytest.approx(4 / 6)
    assert metrics["offpolicy/ratio_mean"] == pytest.approx(sum(r) / 4)
    assert metrics["offpolicy/truncated_frac"] == pytest.approx(1 / 4)
    assert metrics["offpolicy/ratio_above_2_frac"] == pytest.approx(1 / 4)
    assert metrics["offpolicy/ratio_below_half_frac"] == pytest.approx(0.0)
    assert metrics["offpolicy/ratio_mean_abs_log"] == pytest.approx((2 + 0.5 + 0.1) / 4)
    # A counting mask drops the tokens another rank counts.
    counting = torch.tensor([True, True, True, False, True, True])
    masked = trace_metrics(t, held, policy, TokenSums(counting, None), OFFSETS)
    assert masked["offpolicy/ratio_above_2_frac"] == 0.0


def test_the_traces_need_the_engine_log_probs():
    with pytest.raises(RuntimeError, match="engine's log-probs"):
        stale_traces(AlgoConfig(), None, torch.tensor([1, 0, 0]), OFFSETS, monte_carlo=False)
    t = traces()
    with pytest.raises(RuntimeError, match="gather_policy_logprobs"):
        t.ratios_at(torch.arange(6))


def test_the_traces_are_measured_without_the_correction_too():
    engine = torch.zeros(6)
    algo = AlgoConfig(off_policy_correction="none")
    traces = stale_traces(algo, engine, torch.tensor([0, 2, 1]), OFFSETS, monte_carlo=False)
    assert traces is not None and bool(traces.stale.any())  # the step's GAE gets none
