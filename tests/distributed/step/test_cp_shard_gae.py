"""GAE on the critic's context-parallel shards equals the flat path's (issue 18, part 4)."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "cp_shard_gae_worker.py"


def test_shard_gae_equals_flat_gae_dp2_cp2_cp4():
    outputs = run_workers(WORKER, 4, "1x2,2x1,2x2,1x4", timeout=240)
    names = ("vapo", "discounted", "coupled", "vtrace with_micro_batches", "vtrace gathered")
    for name in names:
        for layout in ("DP=1 CP=2", "DP=2 CP=1", "DP=2 CP=2", "DP=1 CP=4"):
            assert f"{layout} {name}: shard GAE equals flat GAE" in outputs[0], outputs[0]
        assert f"DP=1 CP=4 {name}: shard GAE equals flat GAE" in outputs[3]
        assert f"DP=2 CP=2 {name}: shard GAE equals flat GAE" in outputs[3]
    assert (
        "DP=4 CP=1 3 samples: shard GAE equals flat GAE on 1 micro-batches, 0 samples" in outputs[3]
    )
