"""A checkpoint written before an optimizer's first step (a policy frozen through critic
pretraining; Transformer Engine's FusedAdam before its first step) loads and resumes bit for
bit, with the plain and the distributed optimizer, torch's Adam and a lazy stand-in for TE's
(see the worker's docstring)."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "fresh_optimizer_worker.py"


@pytest.mark.parametrize("adam", [pytest.param("torch", marks=pytest.mark.slow), "lazy"])  # CI time
def test_checkpoint_before_first_step_resumes(adam, tmp_path):
    cases = "TP2,DP2-distopt"
    outputs = run_workers(WORKER, 2, adam, cases, str(tmp_path), timeout=300)
    for name in cases.split(","):
        for rank in (0, 1):
            want = f"rank {rank}: {name}-{adam}: saved before the policy's first step"
            assert want in outputs[rank], outputs[rank][-3000:]
