"""Multi-token prediction built in megatron (issue 43): the setting's refusals, the MTP loss's
targets (shifted within each packed sequence), the record's MTP names (depth k is HF layer
num_layers + k; the shared-head copies passed over; the rollout stream without them), the
provider's refusals, and the MTP loss share against a plain cross-entropy."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vapo_megatron.config.mtp import MTPSettings, check_mtp_fits
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.models.mtp import mtp_targets
from vapo_megatron.tiny.model import tiny_deepseek_v3_config, train_tokenizer
from vapo_megatron.weights.record import ModelChunk, ModelRecord, Split

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def hf() -> HFModelConfig:
    tokenizer = train_tokenizer(["12+34=46"], vocab_size=280)
    config = tiny_deepseek_v3_config(tokenizer, num_layers=3).to_dict()
    return HFModelConfig.from_hf(dict(config, num_nextn_predict_layers=1))


@pytest.mark.parametrize("weight", [-0.1, float("nan")])
def test_a_negative_or_nan_weight_is_refused(weight):
    with pytest.raises(ValueError, match=r"policy.mtp.loss_weight=.* must be >= 0"):
        MTPSettings(loss_weight=weight)


def test_the_setting_is_refused_where_it_cannot_run():
    on = MTPSettings(loss_weight=0.1)
    fits = dict(mtp_num_layers=1, vpp=None, cp=1, model="m")
    check_mtp_fits(on, **fits)
    check_mtp_fits(MTPSettings(), **(fits | {"mtp_num_layers": 0, "vpp": 2, "cp": 2}))
    for change, match in (
        ({"mtp_num_layers": 0}, "no multi-token-prediction layers.*loss_weight=0"),
        ({"vpp": 2}, "vpp=2.*vpp=null"),
        ({"cp": 2}, "cp=2.*cp=1"),
    ):
        with pytest.raises(ValueError, match=match):
            check_mtp_fits(on, **(fits | change))


def test_targets_shift_within_each_packed_sequence():
    labels = torch.arange(1, 11)[None]  # two sequences: positions 0-3 and 4-9
    mask = torch.tensor([[0, 1, 1, 0, 0, 0, 1, 1, 1, 0]], dtype=torch.bool)
    cu = torch.tensor([0, 4, 10])
    got, got_mask = mtp_targets(labels, mask, 0, cu)
    assert got.tolist() == [[2, 3, 4, 0, 6, 7, 8, 9, 10, 0]]
    assert got_mask.tolist() == [[1, 1, 0, 0, 0, 1, 1, 1, 0, 0]]
    got, got_mask = mtp_targets(labels, mask, 1, cu)  # depth 2: two ahead
    assert got.tolist() == [[3, 4, 0, 0, 7, 8, 9, 10, 0, 0]]
    got, _ = mtp_targets(labels, mask, 0, None)  # a padded row: one sequence per row
    assert got.tolist() == [[2, 3, 4, 5, 6, 7, 8, 9, 10, 0]]


def test_record_names_the_mtp_layer_on_the_last_stage(hf):
    record = ModelRecord(hf, mtp=True)
    whole = record.tensor_maps(ModelChunk.whole(3))
    mtp = {k: m for k, m in whole.items() if m.mtp}
    assert mtp["mtp.layers.0.eh_proj.weight"].hf_names == ("model.layers.3.eh_proj.weight",)
    assert mtp["mtp.layers.0.eh_proj.weight"].split is Split.COLUMN
    assert mtp["mtp.layers.0.final_layernorm.weight"].hf_names == (
        "model.layers.3.shared_head.norm.weight",
    )
    assert mtp["mtp.layers.0.transformer_layer.mlp.router.expert_bias"].hf_names == (
        "model.layers.3.mlp.gate.e_score_correction_bias",
    )
    experts = [k for k in mtp if ".local_experts." in k]
    assert len(experts) == 2 * 8 and all(mtp[k].expert is not None for k in experts)
    assert not any(m.mtp for k, m in whole.items() if k not in mtp)
    # PP 2: the last stage holds the MTP layer and the embedding's copy it reads.
    last = record.tensor_maps(ModelChunk(layers=range(2, 3), has_embedding=False, has_output=True))
    assert last["embedding.word_embeddings.weight"].tied_copy
    first = record.tensor_maps(ModelChunk(layers=range(0, 2), has_embedding=True, has_output=False))
    assert not any(m.mtp for m in first.values())
    # Megatron -> HF: exported by default, left out of the rollout stream.
    eh = mtp["mtp.layers.0.eh_proj.weight"]
    assert record.exports(eh) and not dataclasses.replace(record, stream_mtp=False).exports(eh)
    assert not ModelRecord(hf).tensor_maps(ModelChunk.whole(3)).keys() & mtp.keys()


def test_record_shapes_and_refusals_of_mtp_names(hf):
    record = ModelRecord(hf, mtp=True)
    h = hf.hidden_size
    assert record.hf_shape("model.layers.3.eh_proj.weight") == (h, 2 * h)
    assert record.hf_shape("model.layers.3.shared_head.head.weight") == (hf.vocab_size, h)
    assert record.hf_shape("model.layers.3.self_attn.q_a_proj.weight") == (32, h)
    for name in ("model.layers.2.eh_proj.weight", "model.layers.4.enorm.weight"):
        with pytest.raises(ValueError, match="unknown HF tensor"):
            record.hf_shape(name)
    with pytest.raises(ValueError, match="unknown HF tensor"):  # without MTP in the model
        ModelRecord(hf).hf_shape("model.layers.3.eh_proj.weight")


def test_hf_to_megatron_loads_the_mtp_layer_and_passes_the_copies_over(hf):
    record = ModelRecord(hf, mtp=True)
    gen = torch.Generator().manual_seed(0)
    chunk = ModelChunk.whole(3)
    tensors = {n: torch.randn(record.hf_shape(n), generator=gen) for n in record.hf_names(chunk)}
    copies = {
        f"model.layers.3.{n}": torch.zeros(hf.vocab_size, hf.hidden_size)
        for n in ("shared_head.head.weight", "embed_tokens.weight")
    }
    shards = record.hf_to_megatron_shards(tensors | copies, 0, 2, chunk)
    eh = shards["mtp.layers.0.eh_proj.weight"]
    assert torch.equal(eh, tensors["model.layers.3.eh_proj.weight"][: hf.hidden_size // 2])
    back = record.megatron_to_hf("mtp.layers.0.eh_proj.weight", [eh, eh], chunk)
    assert back[0][0] == "model.layers.3.eh_proj.weight"
    missing = {k: v for k, v in tensors.items() if k != "model.layers.3.enorm.weight"}
    with pytest.raises(ValueError, match="missing"):
        record.hf_to_megatron_shards(missing, 0, 1, chunk)


def test_provider_refuses_mtp_where_it_cannot_build(hf):
    from vapo_megatron.config.layout import ModelLayout
    from vapo_megatron.models.provider import build_model, transformer_config

    no_mtp = dataclasses.replace(hf, mtp_num_layers=0)
    with pytest.raises(ValueError, match="no multi-token-prediction layers"):
        transformer_config(no_mtp, ModelLayout(), mtp=True)
    config = transformer_config(hf, ModelLayout(), mtp=True)
    assert config.mtp_num_layers == 1
    with pytest.raises(ValueError, match="critic"):
        build_model(hf, config, head="value")


def test_a_recipe_asking_to_train_mtp_on_a_model_without_is_refused_before_any_rank():
    from tests.launcher import REPO_ROOT
    from vapo_megatron.config.checks import check_layouts_on_models
    from vapo_megatron.config.recipe import load_recipe
    from vapo_megatron.weights import hf_io

    dense = REPO_ROOT / "vapo_megatron" / "tiny" / "demo" / "model"  # a qwen2, no MTP
    hf = HFModelConfig.from_hf(hf_io.read_config(dense))
    models = {"policy": (str(dense), hf), "critic": (str(dense), hf)}
    recipe = REPO_ROOT / "recipes" / "tiny_cpu.yaml"
    config = load_recipe(recipe, [f"model.path={dense}", "policy.mtp.loss_weight=0.1"])
    assert config.policy.mtp.trained
    with pytest.raises(ValueError, match=rf"policy.mtp.loss_weight=0.1 but the policy \({dense}\)"):
        check_layouts_on_models(config, models, world_size=2)
    check_layouts_on_models(load_recipe(recipe, [f"model.path={dense}"]), models, world_size=2)
    with pytest.raises(ValueError, match="policy.mtp.loss_weight=-1.0 must be >= 0"):
        load_recipe(recipe, ["policy.mtp.loss_weight=-1"])
