"""The trainer's step on the shard path (each data-parallel rank scores, runs GAE on its
critic's CP shards and trains on its own samples) equals the flat path (every token gathered
to every rank): the same metrics and the same updated weights, at DP2, CP2, PP2, DP2 x CP2 and
TP2 (sequence parallel) x CP2, and DP4 with two samples (ranks that own none); critic
pretraining and GRPO too (see the worker's docstring)."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "shard_path_worker.py"


@pytest.mark.parametrize(
    "world,cases", [(2, ["dp2", "cp2", "pp2"]), (4, ["dp2cp2", "tp2sp_cp2", "dp4_few"])]
)
def test_shard_path_equals_flat_path(world, cases, tmp_path):
    outputs = run_workers(WORKER, world, ",".join(cases), str(tmp_path), timeout=420)
    text = "\n".join(outputs)
    for case in cases:
        assert f"{case} vapo: " in text
    for what in ("critic pretraining", "grpo"):
        assert f"{cases[0]} {what}: " in text
