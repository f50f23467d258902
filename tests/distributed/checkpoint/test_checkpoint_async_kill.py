"""kill -9 while an asynchronous checkpoint save is writing: the previous checkpoint stays
``latest`` and loads, and the next save removes the half-written one (see the worker)."""

from pathlib import Path

import pytest

from tests.launcher import run_workers
from vapo_megatron.checkpoint.directory import latest_step

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "async_kill_worker.py"


def test_kill_during_async_save_keeps_previous_checkpoint(tmp_path):
    with pytest.raises(AssertionError) as killed:
        run_workers(WORKER, 2, "kill", str(tmp_path), timeout=300)
    log = str(killed.value)
    assert log.count("(rc=-9)") == 2, log[-4000:]
    assert log.count("killing during the async save of step 4") == 2, log[-4000:]
    assert latest_step(tmp_path) == 2
    (partial,) = tmp_path.glob("step_00000004.tmp-*")
    assert list(partial.glob("policy/weights/*.distcp")), "the kill came before any write"
    outputs = run_workers(WORKER, 2, "resume", str(tmp_path), timeout=300)
    assert all("resumed from step 2" in out for out in outputs)
