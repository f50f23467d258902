"""A training step with the MTP layer built, at full activation recompute, equals the step
without, bit for bit (packed micro-batches, one rank; ``workers/mtp_recompute_worker.py``;
~35 s on 2 busy cores)."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "mtp_recompute_worker.py"


def test_mtp_under_full_recompute_equals_no_recompute():
    outputs = "\n".join(run_workers(WORKER, 1, timeout=300))
    assert "full recompute: " in outputs
