"""A policy and a critic with different layouts in one 4-rank job, each on its own process
groups: scoring and one training step of each equal transformers + torch on one process (see
the worker's docstring)."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "mixed_layout_worker.py"


@pytest.mark.slow  # CI time (~37s on 2 busy cores); test_shard_path.py holds mixed layouts against a single-rank reference
def test_policy_and_critic_on_their_own_layouts_equal_single_process():
    outputs = run_workers(WORKER, 4, "a,b,c", timeout=240)
    text = "\n".join(outputs)
    for pair, policy, critic in (
        ("a", "2x1x1", "1x1x1"),
        ("b", "1x1x1", "1x2x1"),
        ("c", "2x2x1", "1x1x2"),
    ):
        assert f"{pair} lm {policy}: updated weights max diff" in text
        assert f"{pair} value {critic}: updated weights max diff" in text
        assert f"{pair} scoring max diff" in text
