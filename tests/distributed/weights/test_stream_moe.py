"""The weight stream of a Qwen3-MoE policy over expert parallelism: exact on every rank, in
the plan's order, buckets within bound, each rank holding its own experts (4 gloo ranks)."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # 4 ranks x 3 layouts: ~90 s loaded
WORKER = Path(__file__).parent / "workers" / "stream_moe_worker.py"
# tp, pp, ep, etp (0: TP): expert TP 2 with EP 2; expert TP 1 under TP 2; EP across PP stages.
LAYOUTS = "2,1,2,0;2,1,2,1;1,2,2,0"


def test_moe_stream_is_exact_on_every_rank(tmp_path):
    outputs = run_workers(WORKER, 4, LAYOUTS, str(tmp_path), timeout=600)
    for rank, output in enumerate(outputs):
        for tp, pp, ep, etp in (spec.split(",") for spec in LAYOUTS.split(";")):
            etp = etp if etp != "0" else tp
            assert f"rank {rank}: TP{tp} PP{pp} EP{ep} ETP{etp}: " in output
