"""With vLLM TP 2, only a replica's first rank has the engine's routes; the rollout step takes
the samples and their routes from that rank (``step/rollout.py``), on 2 gloo ranks."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.integration
WORKER = Path(__file__).parent / "leader_routes_worker.py"


def test_routes_come_from_the_first_rank_of_the_replica():
    outputs = run_workers(WORKER, 2, timeout=120)
    for rank, out in enumerate(outputs):
        assert f"LEADER_ROUTES_OK rank {rank}" in out, out
