"""The trainer's step on the routed data path (each model trains on its own DP ranks' samples,
GAE on the critic's, advantages sent to the policy's owners) equals a single-rank reference of
the same step: the same metrics and the same updated weights, at policy TP2 x critic DP2, policy
PP2 x critic CP2, policy DP4 x critic TP2 with two samples (ranks that own none), one layout at
DP2, CP2 x PP2 (shards reassembled) and TP2 (sequence parallel) x CP2 (GAE on the shards);
critic pretraining and GRPO too (see the worker's docstring)."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "shard_path_worker.py"


@pytest.mark.parametrize(
    "world,cases",
    [
        (2, ["tp2_x_dp2", "pp2_x_cp2", "dp2"]),
        # CI time (~45 s): 4 ranks on 2 cores; the critic's CP reassembly under PP is held in
        # the default run by test_critic_replay.py's layouts and test_cp_shard_gae.py
        pytest.param(4, ["dp4_few", "cp2pp2", "tp2sp_cp2"], marks=pytest.mark.slow),
    ],
)
def test_routed_step_equals_single_rank_reference(world, cases, tmp_path):
    run_workers(WORKER, 1, "ref", ",".join(cases), str(tmp_path), timeout=300)
    outputs = run_workers(WORKER, world, "run", ",".join(cases), str(tmp_path), timeout=420)
    text = "\n".join(outputs)
    for case in cases:
        assert f"{case} vapo: " in text
    for what in ("critic pretraining", "grpo"):
        assert f"{cases[0]} {what}: " in text
