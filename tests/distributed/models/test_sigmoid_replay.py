"""Routing replay with DeepSeek-V3/GLM-4.5's sigmoid router, and its expert bias in training
(one gloo rank, tiny DeepSeek-V3 through ModelEngine; ``workers/sigmoid_replay_worker.py``):

- replayed experts are the ones every MoE layer uses (the dense first layer has no router and
  no routes), with weights from the *current* scores: the unbiased sigmoid of the chosen
  experts, renormalised, times ``routed_scaling_factor``; the routers get gradients;
- the bias does change the router's own choice (else the checks above could not see it);
- after a training step the bias is unchanged at ``moe.router_bias_update_rate`` 0 (the
  default) and moves by the rate (+-1e-3 per expert, megatron's sign update) when set.
"""

import json
from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "sigmoid_replay_worker.py"


def test_sigmoid_replay_forces_experts_and_the_bias_stays_frozen(tmp_path: Path) -> None:
    run_workers(WORKER, 1, str(tmp_path), timeout=300)
    numbers = json.loads((tmp_path / "numbers.json").read_text())
    assert numbers["replay_weight_max_diff"] < 1e-6
    assert numbers["bias_changes_choice"] > 0
