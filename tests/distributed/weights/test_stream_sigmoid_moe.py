"""The weight stream of a DeepSeek-V3 and a GLM-4.5 policy under virtual pipeline stages: every
HF tensor (the expert-score bias included) exact on every rank, in the plan's order, each
model chunk holding the record's shards of its own layers (4 gloo ranks,
``workers/stream_sigmoid_moe_worker.py``): PP2 x VPP2 with TP2, and with EP2."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # ~2.5 min per family on 2 busy cores
WORKER = Path(__file__).parent / "workers" / "stream_sigmoid_moe_worker.py"
LAYOUTS = "2,2,2,1;1,2,2,2"  # tp, pp, vpp, ep
TENSORS = {"deepseek_v3": 129, "glm4_moe": 137}  # the tiny models' HF tensors (4 layers)


@pytest.mark.parametrize("family", sorted(TENSORS))
def test_sigmoid_moe_stream_is_exact_under_virtual_pipeline(family, tmp_path):
    outputs = run_workers(WORKER, 4, family, LAYOUTS, str(tmp_path), timeout=600)
    for rank, output in enumerate(outputs):
        for tp, pp, vpp, ep in (spec.split(",") for spec in LAYOUTS.split(";")):
            line = f"rank {rank}: {family} TP{tp} PP{pp} VPP{vpp} EP{ep}: {TENSORS[family]} exact"
            assert line in output
