"""One VAPO optimizer step of policy and critic at TP2, PP2, CP2, DP2 (distributed optimizer)
equals the same step in transformers + torch on one process (see the worker's docstring)."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "train_step_worker.py"


@pytest.mark.parametrize(
    "layouts",
    ["TP2,TP2-SP-packed,PP2", "CP2,CP2-packed,DP2-distopt"],
)
def test_one_step_equals_single_process(layouts):
    outputs = run_workers(WORKER, 2, layouts, timeout=300)
    for name in layouts.split(","):
        for head in ("lm", "value"):
            assert any(f"{name} {head}: updated weights max diff" in out for out in outputs)
