"""The TE name fixture (``tests/unit/weights/test_te_names.py``) against a model megatron builds.

One process (``workers/te_names_worker.py``) builds every case of the fixture at TP 2, PP 1
and 2, with megatron-core's Transformer Engine layer spec around stand-ins of TE 2.11's modules,
through the project's ``build_model``. Each chunk's parameter names and its whole state-dict key
set must equal the fixture's, and the record's names must be the parameters.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launcher import run_workers
from tests.unit.weights.test_record import megatron_config
from tests.unit.weights.test_te_names import CASES, TP, te_names, te_record
from vapo_megatron.weights.record import ModelChunk

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "te_names_worker.py"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("te_names") / "names.json"
    run_workers(WORKER, 1, str(out), timeout=120)
    return json.loads(out.read_text())


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_fixture_is_the_whole_key_set_of_a_built_te_model(built, case, pp):
    record = te_record(case)
    config = megatron_config(record, TP, pp)
    for stage in range(pp):
        chunk = ModelChunk.for_stage(config, stage)
        parameters, keys = te_names(record, chunk)
        model = built[f"{case}/{pp}/{stage}"]
        assert sorted(model["parameters"]) == sorted(parameters)
        assert sorted(model["state_dict"]) == sorted(keys)
        assert sorted(record.tensor_maps(chunk)) == sorted(model["parameters"])


def test_tied_policy_and_critic_output_layers(built):
    # What the issue found: megatron builds a tied PP 1 policy's output layer without a weight
    # (it uses the embedding's) but with an _extra_state; the critic's value head has none.
    policy = built["policy-tied/1/0"]["state_dict"]
    assert "output_layer._extra_state" in policy and "output_layer.weight" not in policy
    critic = built["critic/1/0"]["state_dict"]
    assert "output_layer.weight" in critic and "output_layer._extra_state" not in critic
