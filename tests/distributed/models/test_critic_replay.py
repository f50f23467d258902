"""Routing replay of an MoE critic: the routes its scoring pass records are transformers' and
its update's forward (and backward recompute) replays them, at EP2, TP2 with sequence
parallelism, CP2 and PP2 (``workers/critic_replay_worker.py`` says what each checks)."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "critic_replay_worker.py"


LAYOUTS = ["1x1x1x2", "2x1x1x1", "1x1x2x1", "1x2x1x1"]  # TP x PP x CP x EP on 2 ranks


def test_critic_replays_its_scoring_routes(tmp_path):
    outputs = run_workers(WORKER, 2, ",".join(LAYOUTS), str(tmp_path), timeout=420)
    text = "\n".join(outputs)
    for layout in LAYOUTS:  # one launch: the layouts one after another on new groups
        assert len(list(tmp_path.glob(f"ok-{layout}-*"))) == 2, text[-3000:]
    print("\n".join(line for line in text.splitlines() if line.startswith("rank ")))


@pytest.mark.slow  # 4 ranks on 2 cores, ~3 min
def test_critic_replays_its_scoring_routes_with_cp_under_pp_and_ep_x_tp_x_cp(tmp_path):
    """CP under a pipeline pads every row to one length, which moves a row's last sequence's
    CP chunks between the scoring pass and the updates: the routes are whole samples."""
    layouts = ["1x2x2x1", "2x1x2x2"]
    outputs = run_workers(WORKER, 4, ",".join(layouts), str(tmp_path), timeout=600)
    text = "\n".join(outputs)
    for layout in layouts:
        assert len(list(tmp_path.glob(f"ok-{layout}-*"))) == 4, text[-3000:]
