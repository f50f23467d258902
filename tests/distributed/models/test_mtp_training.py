"""A tiny DeepSeek-V3 policy with its MTP layer built in megatron and trained
(``policy.mtp.loss_weight`` 0.1) for two steps through the trainer's path on 2 ranks, at EP 2
(the tiny DeepSeek recipe's layout), PP 2 and TP 2 with sequence parallelism
(``workers/mtp_training_worker.py``): the
record round trip with the MTP layer in the model is bit-identical, the rollout stream leaves
it out, ``mtp_loss`` is logged and falls, the MTP weights move, the main model is
bit-identical to the frozen path's, routing replay takes the decoder's routers only, the
training checkpoint with the MTP layer resumes exactly, and at PP 2 the last stage's copy of
the embedding follows the trained one (~55-100 s each on 2 busy cores)."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = Path(__file__).parent / "workers" / "mtp_training_worker.py"


@pytest.mark.parametrize("layout", ["ep2", "pp2", "tp2"])
def test_mtp_training_moves_the_mtp_layer_only_and_resumes(tmp_path, layout):
    outputs = "\n".join(run_workers(WORKER, 2, str(tmp_path), layout, timeout=600))
    for line in ("round trip: ", "bit-identical to the frozen path", "resume: "):
        assert line in outputs
    if layout == "pp2":
        assert "embedding copy equals the trained embedding" in outputs
