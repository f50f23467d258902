"""The TE name fixture (``tests/unit/weights/test_te_names.py``) against a model megatron builds.

One process (``workers/te_names_worker.py``) builds every case of the fixture at TP 2, PP 1
and 2 (Qwen2, Qwen3, Qwen3-MoE with grouped-GEMM experts at EP 1 and 2 and with SequentialMLP
experts), with megatron-core's Transformer Engine layer spec around stand-ins of TE 2.11's
modules, through the project's ``build_model``. Each (stage, EP rank) chunk's parameter names
and its whole state-dict key set must equal the fixture's, and the record's names must be the
parameters. For Qwen3-MoE the local spec's checkpoint keys (after its key map) must be TE's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launcher import run_workers
from tests.unit.weights.test_te_names import CASES, TP, case_config, te_names, te_record
from vapo_megatron.weights.record import ModelChunk

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "te_names_worker.py"
MOE_CASES = [case for case in CASES if te_record(case).config.is_moe]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("te_names") / "names.json"
    run_workers(WORKER, 1, str(out), timeout=180)
    return json.loads(out.read_text())


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_fixture_is_the_whole_key_set_of_a_built_te_model(built, case, pp):
    record = te_record(case)
    config = case_config(case, TP, pp)
    ep = CASES[case].ep if record.config.is_moe else 1
    for stage in range(pp):
        for ep_rank in range(ep):
            chunk = ModelChunk.for_stage(config, stage, ep_rank=ep_rank)
            parameters, keys = te_names(record, chunk)
            model = built[f"{case}/{pp}/{stage}/{ep_rank}"]
            assert sorted(model["parameters"]) == sorted(parameters)
            assert sorted(model["state_dict"]) == sorted(keys)
            assert sorted(record.tensor_maps(chunk)) == sorted(model["parameters"])


def test_tied_policy_and_critic_output_layers(built):
    # What the issue found: megatron builds a tied PP 1 policy's output layer without a weight
    # (it uses the embedding's) but with an _extra_state; the critic's value head has none.
    policy = built["policy-tied/1/0/0"]["state_dict"]
    assert "output_layer._extra_state" in policy and "output_layer.weight" not in policy
    critic = built["critic/1/0/0"]["state_dict"]
    assert "output_layer.weight" in critic and "output_layer._extra_state" not in critic


@pytest.mark.parametrize("case", MOE_CASES)
def test_local_moe_checkpoint_keys_are_te_ones(built, case):
    """megatron-core 0.16.1's local spec maps ``pre_mlp_layernorm.`` to
    ``mlp.linear_fc1.layer_norm_`` whatever the MLP; its TE spec keeps an MoE layer's pre-MLP
    norm as its own module. Both models' checkpoint keys outside the experts (stacked layers,
    ``_extra_state`` left out) must agree, so a checkpoint of one loads into the other."""
    for ep_rank in range(CASES[case].ep):
        keys = built[f"{case}/1/0/{ep_rank}"]["checkpoint_keys"]
        assert keys["local"] == keys["te"]
        assert "decoder.layers.pre_mlp_layernorm.weight" in keys["te"]
        assert not any("linear_fc1" in key for key in keys["te"])
