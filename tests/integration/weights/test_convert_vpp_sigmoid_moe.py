"""A DeepSeek-V3 (YaRN) and a GLM-4.5 checkpoint that the converter wrote at TP1 x PP2 x EP2
load into models built with virtual pipeline stages (PP2 x VPP2 with TP2, and with EP2), each
chunk's parameters and buffers (the expert-score bias) equal to the record's shards of its own
layers: the dense layer 0 in pipeline rank 0's first chunk, the MoE layer 2 in its second (4
gloo ranks, ``workers/convert_vpp_worker.py``)."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # ~2 min per family on 2 busy cores
WORKER = Path(__file__).parent / "workers" / "convert_vpp_worker.py"
LAYOUTS = "2,2,2,1;1,2,2,2"  # tp, pp, vpp, ep of the loads


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_a_converted_checkpoint_loads_under_virtual_pipeline(family, tmp_path):
    outputs = run_workers(WORKER, 4, family, LAYOUTS, str(tmp_path), timeout=600)
    for rank, output in enumerate(outputs):
        for tp, pp, vpp, ep in (spec.split(",") for spec in LAYOUTS.split(";")):
            assert f"rank {rank}: {family} TP{tp} PP{pp} VPP{vpp} EP{ep}: " in output
