"""Megatron GPTModels loaded through the record give transformers' logits at every layout.

One 4-rank launch (``workers/record_worker.py``) runs TP 1/2/4 (TP=4 > 2 KV heads), PP 2,
TP2 x PP2 and PP2 x VPP2 for an untied Qwen2, a tied Qwen2 and a Llama 3 with llama3 RoPE
scaling, all with a vocabulary (250) that Megatron pads; the tests read what each rank measured.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "record_worker.py"
TOLERANCE = 1e-4  # fp32; measured <= 3.4e-6 with logits up to ~5
MODELS = ("qwen2", "qwen2-tied", "llama3")
LAYOUTS = ("TP1xPP1", "TP2xPP1", "TP4xPP1", "TP1xPP2", "TP2xPP2", "TP1xPP2xVPP2")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("record")
    run_workers(WORKER, 4, str(out_dir), timeout=150)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_logits_match_transformers(ranks, model, layout):
    # Every last-stage rank (each TP rank of each data-parallel replica) reports its logits.
    reports = [
        r["checks"][f"{model} {layout}"] for r in ranks if f"{model} {layout}" in r["checks"]
    ]
    pp = 2 if "PP2" in layout else 1
    assert len(reports) == 4 // pp
    for report in reports:
        assert report["max_abs_diff"] < TOLERANCE, report
        assert report["padding_logits_zero"], report


def test_the_llama3_check_can_fail(ranks):
    # Dropping llama3 RoPE scaling moves these logits far beyond the tolerance.
    assert ranks[0]["rope_scaling_effect"] > 100 * TOLERANCE
