"""Qwen3 and Qwen3-MoE logits (policy) and values (critic) of the production model path equal
transformers' at TP1, TP2, PP2, CP2, EP2, EP4 and EP2 x TP2, padded and packed (4 gloo ranks;
``workers/qwen3_parity_worker.py``). MoE layouts with TP > 1 run with sequence parallelism.

The default tier runs the layouts that only MoE has (EP2, EP2 x TP2: the all-to-all dispatcher,
expert TP's uneven gathers) and Qwen3's explicit head_dim and q/k norms at TP2; the slow tier
the rest of the sweep."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "qwen3_parity_worker.py"


def _check(family: str, layouts: list[str], timeout: float) -> None:
    outputs = "\n".join(run_workers(WORKER, 4, family, ",".join(layouts), timeout=timeout))
    for layout in layouts:
        for head in ("lm", "value"):
            for batch in ("pad", "pack"):
                assert f"{layout} {head} {batch}: max diff" in outputs


def test_qwen3_moe_matches_transformers_at_ep2_and_ep2_tp2():
    _check("qwen3_moe", ["1x1x1x2", "2x1x1x2"], timeout=400)


@pytest.mark.slow  # CI time (~30s on 2 busy cores); Qwen3's q/k norms are in the MoE parity above; dense names in test_te_names.py
def test_qwen3_matches_transformers_at_tp2():
    _check("qwen3", ["2x1x1x1"], timeout=300)


@pytest.mark.slow
def test_qwen3_moe_matches_transformers_at_every_layout():
    _check("qwen3_moe", ["1x1x1x1", "2x1x1x1", "1x2x1x1", "1x1x2x1", "1x2x1x2", "1x1x1x4"], 900)


@pytest.mark.slow
def test_qwen3_matches_transformers_at_every_layout():
    _check("qwen3", ["1x1x1x1", "1x2x1x1", "1x1x2x1", "2x2x1x1"], timeout=600)
