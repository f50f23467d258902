"""Vocabulary-parallel log-probs and entropy against one process, at TP 2 and 4."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "logprob_worker.py"


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_logprobs(tp):
    outputs = run_workers(WORKER, tp, timeout=120)
    assert all(
        f"TP={tp} log-probs, entropy and gradients equal one process" in out for out in outputs
    )
