"""Policy logits and critic values of the production model path equal transformers' at every
(TP, PP, CP) layout of the issue, for padded and packed batches (one 4-rank launch)."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "parity_worker.py"
LAYOUTS = ["1x1x1", "2x1x1", "1x2x1", "1x1x2", "2x2x1", "2x1x2"]


def test_logits_and_values_match_transformers_at_every_layout():
    outputs = run_workers(WORKER, 4, ",".join(LAYOUTS), timeout=240)
    last_stage_lines = "\n".join(outputs)
    for layout in LAYOUTS:
        for head in ("lm", "value"):
            for batch in ("pad", "pack"):
                assert f"{layout} {head} {batch}: max diff" in last_stage_lines
