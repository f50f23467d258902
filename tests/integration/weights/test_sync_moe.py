"""A Qwen3-MoE policy at EP 2 -> weight stream (expert gather over EP) -> vLLM-CPU engines
inside the 2-rank job: greedy tokens equal transformers' on the synced weights."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytest.importorskip("vllm", reason="vllm is not installed (make test installs vllm-cpu)")
pytestmark = pytest.mark.integration
WORKER = Path(__file__).parent / "workers" / "sync_moe_worker.py"


def test_ep2_policy_to_vllm_greedy_equals_transformers(tmp_path):
    outputs = run_workers(WORKER, 2, str(tmp_path), timeout=600)
    for rank, output in enumerate(outputs):
        for name in ("B", "A"):
            assert f"rank {rank}: EP2 -> vLLM: {name}'s greedy equals transformers'" in output
