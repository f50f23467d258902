"""Activation recompute changes what is kept for backward, never the gradients (TP2, CP2)."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "recompute_worker.py"


def test_recompute_keeps_gradients_at_tp2_and_cp2():
    outputs = run_workers(WORKER, 2, timeout=300)
    for rank, out in enumerate(outputs):
        for layout in ("TP2", "CP2"):
            for label in ("selective", "full-uniform-1", "full-block-1"):
                assert f"rank {rank}: {layout} {label}: same gradients" in out, out
        assert f"rank {rank}: critic CP2 full-uniform-1: same gradients" in out, out
