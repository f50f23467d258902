"""The engine's routes stay where they were generated and go to the policy ranks that train on
each sample (routing replay, ``step/engine_routes.py``), as tensors."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "route_gather_worker.py"


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # CI time
def test_routes_reach_exactly_their_owners(world):
    outputs = run_workers(WORKER, world, timeout=120)
    for rank, out in enumerate(outputs):
        assert f"ROUTE_GATHER_OK rank {rank}" in out, out
