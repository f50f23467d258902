"""A training checkpoint saved at DP2 or TP2 (2 ranks) resumes at DP1 TP1 (1 rank), and the
next two steps stay within float tolerance of the uninterrupted run: the distributed
optimizer's default dp_reshardable format across DP, its fully_reshardable format and the plain
optimizer across TP (see the worker's docstring for the tolerances and why). A checkpoint of
the old per-rank format is refused with the command that continues from it."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "reshard_checkpoint_worker.py"


def test_resume_at_another_layout(tmp_path):
    run_workers(WORKER, 2, "save", str(tmp_path), timeout=300)
    (out,) = run_workers(WORKER, 1, "load", str(tmp_path), timeout=300)
    for case in ("DP2", "TP2-full", "TP2-plain", "DP2-unstepped"):
        assert f"{case} -> DP1 TP1: next 2 steps' grad norms within" in out, out[-3000:]
    assert "RNG states not restored" in out
    assert "old per-rank checkpoints refused with the command that continues from them" in out
