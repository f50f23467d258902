"""The policy weight stream: every rank gets every HF tensor, bit-exact, in buckets of at most
the bound (a larger tensor alone), in the plan's order."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "stream_worker.py"


def test_stream_is_exact_on_every_rank():
    layouts = ["2x1", "1x2", "2x2", "1x4"]
    outputs = run_workers(WORKER, 4, ",".join(layouts), timeout=240)
    for out in outputs:
        for tie, count in (("False", 51), ("True", 50)):
            for layout in layouts:
                tp, pp = layout.split("x")
                assert f"tie={tie} TP{tp}xPP{pp}: {count} tensors exact" in out
