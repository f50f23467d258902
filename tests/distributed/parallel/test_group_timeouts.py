"""Every process group of both models (TP, PP, CP, DP, DPxCP and the rest of megatron's
collection, and anything megatron's DDP or optimizer makes) is made with the recipe's
``trainer.dist_timeout_minutes``: a group made without ``timeout=`` keeps its backend's
default (NCCL: 10 minutes) whatever the default group was given. vLLM's own groups are checked
in a whole run (``test_placement.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.trainer_runs import plain_env
from tests.launcher import REPO_ROOT

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "group_timeout_worker.py"
TINY = REPO_ROOT / "recipes" / "tiny_cpu.yaml"


@pytest.mark.timeout(300)
def test_every_model_group_gets_the_recipe_timeout() -> None:
    # World 8, ranks 0 and 5: policy TP2 x PP2 (distributed optimizer), critic CP2, DP the rest.
    overrides = ["policy.layout.tp=2", "policy.layout.pp=2",
                 "policy.optim.distributed_optimizer=true", "critic.layout.tp=1",
                 "critic.layout.cp=2", "trainer.dist_timeout_minutes=45"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(WORKER), "8", "0,5", str(TINY), *overrides],
        capture_output=True, text=True, timeout=240, cwd=REPO_ROOT, env=plain_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("GROUPS "))
    report = json.loads(line.removeprefix("GROUPS "))
    assert report["untimed"] == []
    # Both ranks, both models: every TP/PP/CP/DP... group of each layout was made.
    assert report["calls"] >= 2 * (8 + 8), report
    assert report["timeouts"] == {"0:45:00": report["calls"]}
