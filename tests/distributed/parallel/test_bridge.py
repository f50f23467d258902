"""The separate placement's worlds and bridge (parallel/placement.py, weights/bridge_stream.py,
step/trajectory_wire.py) on 4 gloo ranks: 2 trainer ranks, 2 rollout ranks."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "bridge_worker.py"


def test_worlds_split_and_the_bridge_carries_weights_orders_and_batches():
    outputs = run_workers(WORKER, 4, timeout=180)
    assert "global 0: trainer 0/2" in outputs[0] and "global 3: rollout 1/2" in outputs[3]
    for rank in (0, 1):
        assert f"trainer {rank}/2: batch and routes arrived bit for bit" in outputs[rank]
    for rank in (2, 3):
        assert f"rollout {rank - 2}/2: buckets arrived bit for bit" in outputs[rank]
