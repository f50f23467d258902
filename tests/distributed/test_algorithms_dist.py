"""Context-parallel GAE and sharding invariance of the losses, in real gloo processes."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "algo_worker.py"


def test_cp_gae_and_invariance_up_to_4_ranks():
    outputs = run_workers(WORKER, 4, "1x1,2x1,4x1,1x2,2x2,1x4", timeout=180)
    assert "CP=4 GAE equals full-sequence GAE, padded and packed" in outputs[3]
    assert "CP=4 GAE with importance traces equals full-sequence GAE" in outputs[3]
    assert "DP=2 CP=2 micro=3" in outputs[3]


@pytest.mark.slow  # CI time (~32s on 2 busy cores); 8 ranks; up to 4 ranks in the test above
def test_invariance_dp4_cp2_on_8_ranks():
    outputs = run_workers(WORKER, 8, "4x2", timeout=240)
    assert all("DP=4 CP=2 micro=3: loss, grads, metrics equal" in out for out in outputs)
