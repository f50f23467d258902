"""The trainer's mini-batch update is invariant to how the mini-batch is split over
data-parallel ranks and micro-batches (see the worker's docstring)."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "train_on_worker.py"


def test_update_is_invariant_to_the_split():
    outputs = run_workers(WORKER, 2, timeout=240)
    for head in ("value", "lm"):
        assert f"rank 0: {head}: DP2 (budget 24) = TP2 (one micro-batch)" in outputs[0]
