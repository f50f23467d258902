"""A tiny DeepSeek-V3 policy with its MTP layer built in megatron and trained
(``policy.mtp.loss_weight`` 0.1) for two steps through the trainer's path at EP 2 on 2 ranks
(``workers/mtp_training_worker.py``): the record round trip with the MTP layer in the model is
bit-identical, the rollout stream leaves it out, ``mtp_loss`` is logged and falls, the MTP
weights move, and the main model is bit-identical to the frozen path's (~70 s on 2 busy
cores)."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = Path(__file__).parent / "workers" / "mtp_training_worker.py"


def test_mtp_training_moves_the_mtp_layer_only():
    outputs = "\n".join(run_workers(WORKER, 2, timeout=500))
    assert "round trip: " in outputs and "bit-identical to the frozen path" in outputs
