"""Overlapped gradient reduction and parameter gather equal the plain path (see the worker)."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "overlap_worker.py"


def test_overlapped_updates_equal_plain_ones():
    outputs = run_workers(WORKER, 2, timeout=240)
    for head in ("value", "lm"):
        assert f"rank 0: {head}: overlapped = plain over 3/1/2 micro-batches" in outputs[0]
