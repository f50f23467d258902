"""``all_gather_varlen`` (pieces broadcast into place) over the world and a subgroup, with
empty and unequal pieces (see the worker)."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "varlen_worker.py"


def test_varlen_gather_over_world_and_subgroup():
    outputs = run_workers(WORKER, 4, timeout=120)
    assert all("varlen gather ok" in out for out in outputs)
