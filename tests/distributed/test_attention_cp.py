"""Context-parallel and packed core attention equals CP = 1, module and GPTModel, on gloo."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "attention_worker.py"


def test_cp2_and_cp4_equal_cp1_for_module_and_gpt_model():
    outputs = run_workers(WORKER, 4, timeout=150)
    for rank, out in enumerate(outputs):
        for cp in (2, 4):
            assert f"rank {rank}: module CP={cp} bshd+thd outputs and q/k/v grads equal" in out
            assert f"rank {rank}: model CP={cp} dense+packed logits and grads equal" in out
    assert "max diff model packed vs alone logits" in outputs[0]
