"""Trajectories cross ranks as tensors (token ids, log-probs, metadata rows), never pickled."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "trajectory_gather_worker.py"


def test_generate_and_grade_gathers_tensors_in_group_order():
    outputs = run_workers(WORKER, 2, timeout=120)
    for rank, out in enumerate(outputs):
        assert f"TRAJECTORY_GATHER_OK rank {rank}" in out, out
