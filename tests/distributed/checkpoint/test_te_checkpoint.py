"""Loading a checkpoint saved under the other layer spec tolerates ``_extra_state`` alone.

One 2-rank TP2 launch (``workers/te_checkpoint_worker.py``): a local-spec checkpoint (the kind
``tools/convert.py`` writes) into a Transformer Engine-style model and back, and the real
mismatches that must still fail. The tests read what each rank reported.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "te_checkpoint_worker.py"
RANKS = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("te_checkpoint")
    run_workers(WORKER, RANKS, str(out_dir), timeout=150)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(RANKS)]


def test_same_spec_loads_without_tolerating_anything(ranks):
    for report in ranks:
        case = report["local->local"]
        assert "error" not in case, case
        assert case["equal"] and case["log"] == []


def test_te_model_loads_a_local_checkpoint_tolerating_only_extra_state(ranks):
    for rank, report in enumerate(ranks):
        case = report["local->te"]
        assert "error" not in case, case
        assert case["equal"], case
        assert not case["extra_state_loaded"]  # absent from the checkpoint: left as it was
        if rank == 0:  # rank 0 logs it
            (line,) = case["log"]
            assert "tolerated 1 _extra_state entry absent from the checkpoint and 0" in line


def test_local_model_loads_a_te_checkpoint(ranks):
    for rank, report in enumerate(ranks):
        case = report["te->local"]
        assert "error" not in case, case
        assert case["equal"], case
        if rank == 0:
            (line,) = case["log"]
            assert "tolerated 0 _extra_state entries absent from the checkpoint and 1" in line


def test_a_missing_weight_fails_on_every_rank(ranks):
    for report in ranks:
        case = report["missing weight"]
        assert case.get("error") == "ValueError", case
        assert (
            "1 tensor(s) the checkpoint lacks ['decoder.final_layernorm.bias']" in case["message"]
        )


def test_an_unexpected_weight_fails(ranks):
    for report in ranks:
        case = report["unexpected weight"]
        assert case.get("error") == "ValueError", case
        assert "1 the model does not have ['decoder.final_layernorm.bias']" in case["message"]
