"""The engine's routes cross ranks with the trajectories (routing replay), as tensors."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "route_gather_worker.py"


def test_generate_and_grade_gathers_routes_in_group_order():
    outputs = run_workers(WORKER, 2, timeout=120)
    for rank, out in enumerate(outputs):
        assert f"ROUTE_GATHER_OK rank {rank}" in out, out
