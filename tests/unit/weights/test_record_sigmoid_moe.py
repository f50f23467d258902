"""The record's DeepSeek-V3 and GLM-4.5 rows: MLA (with and without q_lora_rank), the dense
first layers, shared experts, the expert-score bias (a buffer), the TE names of MLA; HF names
of the wrong layer kind and unknown names are errors; and the config refusals, each naming
its value and fix."""

from __future__ import annotations

import pytest
import torch

from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.tiny.model import tiny_deepseek_v3_config, tiny_glm4_moe_config, train_tokenizer
from vapo_megatron.weights.record import ModelChunk, ModelRecord, Split

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def configs() -> dict[str, dict]:
    tokenizer = train_tokenizer(["12+34=46"], vocab_size=280)
    return {
        "deepseek_v3": tiny_deepseek_v3_config(tokenizer, num_layers=3, yarn=True).to_dict(),
        "glm4_moe": tiny_glm4_moe_config(tokenizer, num_layers=3).to_dict(),
    }


def full_hf(record: ModelRecord, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    names = record.hf_names(ModelChunk.whole(record.config.num_layers))
    return {name: torch.randn(record.hf_shape(name), generator=gen) for name in names}


def test_deepseek_v3_layers(configs):
    record = ModelRecord(HFModelConfig.from_hf(configs["deepseek_v3"]))
    maps = record.tensor_maps(ModelChunk.whole(3))
    dense = {k[len("decoder.layers.0.") :]: m for k, m in maps.items() if ".layers.0." in k}
    moe = {k[len("decoder.layers.1.") :]: m for k, m in maps.items() if ".layers.1." in k}
    assert dense["self_attention.linear_q_down_proj.weight"].hf_names == (
        "model.layers.0.self_attn.q_a_proj.weight",
    )
    assert dense["self_attention.linear_kv_down_proj.weight"].split is Split.COLUMN
    assert dense["self_attention.kv_layernorm.weight"].split is Split.REPLICATED
    assert dense["mlp.linear_fc1.weight"].split is Split.GATE_UP
    assert "mlp.router.weight" not in dense
    assert moe["mlp.router.expert_bias"].hf_names == (
        "model.layers.1.mlp.gate.e_score_correction_bias",
    )
    assert moe["mlp.shared_experts.linear_fc2.weight"].split is Split.ROW
    assert "mlp.linear_fc1.weight" not in moe
    assert sum(".local_experts." in k for k in moe) == 2 * 8
    te = ModelRecord(record.config, layer_spec="te").tensor_maps(ModelChunk.whole(3))
    assert te["decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight"].hf_names == (
        "model.layers.0.self_attn.q_a_layernorm.weight",
    )
    assert te["decoder.layers.0.self_attention.linear_q_down_proj.weight"].split is Split.REPLICATED


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("tp", [1, 2])
def test_shards_round_trip_over_tp(configs, family, tp):
    record = ModelRecord(HFModelConfig.from_hf(configs[family]))
    hf = full_hf(record)
    chunk = ModelChunk.whole(3)
    shards = [record.hf_to_megatron_shards(hf, r, tp, chunk) for r in range(tp)]
    back = {}
    for name in shards[0]:
        back.update(record.megatron_to_hf(name, [s[name] for s in shards], chunk))
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_without_q_lora_rank_the_query_is_one_projection(configs):
    config = dict(configs["deepseek_v3"], q_lora_rank=None)
    record = ModelRecord(HFModelConfig.from_hf(config))
    names = record.hf_names(ModelChunk.whole(3))
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert not any("q_a_" in n or "q_b_" in n for n in names)
    assert record.hf_shape("model.layers.0.self_attn.q_proj.weight") == (4 * 32, 64)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.1.mlp.gate_proj.weight",  # a dense name at an MoE layer
        "model.layers.0.mlp.gate.weight",  # a router at the dense layer
        "model.layers.0.mlp.shared_experts.up_proj.weight",
        "model.layers.1.mlp.experts.8.up_proj.weight",  # expert out of range
        "model.layers.3.self_attn.q_a_proj.weight",  # an MTP layer (none in this config)
        "model.layers.0.self_attn.q_proj.weight",  # MLA with q_lora_rank has none
    ],
)
def test_wrong_names_are_errors(configs, name):
    record = ModelRecord(HFModelConfig.from_hf(configs["deepseek_v3"]))
    with pytest.raises(ValueError, match="unknown HF tensor"):
        record.hf_shape(name)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"n_group": 2, "topk_group": 1}, "agree only when that is 2"),
        ({"norm_topk_prob": False}, "norm_topk_prob=false is not supported"),
        ({"rope_interleave": False}, "rope_interleave=false"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
        ({"topk_method": "greedy"}, "topk_method='greedy'"),
        ({"attention_bias": True}, "attention_bias=true is not supported"),
        ({"first_k_dense_replace": 3}, "first_k_dense_replace=3"),
    ],
)
def test_deepseek_v3_refusals(configs, change, match):
    with pytest.raises(ValueError, match=match):
        HFModelConfig.from_hf(dict(configs["deepseek_v3"], **change))


def test_megatron_config_fields(configs):
    dsv3 = HFModelConfig.from_hf(configs["deepseek_v3"]).transformer_config_kwargs()
    assert dsv3["moe_layer_freq"] == [0, 1, 1]
    assert (dsv3["moe_router_num_groups"], dsv3["moe_router_group_topk"]) == (4, 2)
    assert dsv3["moe_router_topk_scaling_factor"] == 2.5
    assert dsv3["moe_shared_expert_intermediate_size"] == 32
    assert dsv3["moe_router_enable_expert_bias"] and dsv3["moe_router_bias_update_rate"] == 0.0
    assert (dsv3["rope_type"], dsv3["rotary_scaling_factor"], dsv3["mscale_all_dim"]) == (
        "yarn", 4.0, 1.0,
    )  # fmt: skip
    assert dsv3["rotary_base"] == 10000.0  # MLA's RoPE is the attention's, not GPTModel's
    glm = HFModelConfig.from_hf(configs["glm4_moe"])
    assert glm.gpt_model_kwargs(1)["rotary_percent"] == 0.5
    assert glm.qkv_bias and glm.qk_layernorm and glm.mla is None
    assert glm.transformer_config_kwargs()["add_qkv_bias"]


def test_kimi_k2_reads_as_deepseek_v3(configs):
    """Kimi-K2's config.json: model_type kimi_k2, DeepseekV3ForCausalLM, no groups, YaRN in
    the transformers 4.x dialect (``rope_scaling`` with ``type``)."""
    config = dict(configs["deepseek_v3"], model_type="kimi_k2", n_group=1, topk_group=1)
    config.pop("rope_parameters")
    config.update(
        architectures=["DeepseekV3ForCausalLM"],
        rope_theta=50000.0,
        rope_scaling={
            "type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
            "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        },
    )  # fmt: skip
    hf = HFModelConfig.from_hf(config)
    assert hf.family == "deepseek_v3" and hf.moe_num_groups == 1
    assert hf.hf_architecture("lm") == "DeepseekV3ForCausalLM"
    kwargs = hf.transformer_config_kwargs()
    assert (kwargs["rotary_base"], kwargs["rotary_scaling_factor"], kwargs["beta_fast"]) == (
        50000.0, 32.0, 1.0,
    )  # fmt: skip
    assert kwargs["moe_router_num_groups"] is None


def test_mtp_layers_are_passed_over_by_megatron_and_carried(configs, tmp_path):
    from vapo_megatron.weights.mtp import is_mtp_tensor, mtp_tensors, write_mtp

    config = dict(configs["deepseek_v3"], num_nextn_predict_layers=1)
    hf = HFModelConfig.from_hf(config)
    record = ModelRecord(hf)
    tensors = full_hf(record)
    mtp = {"model.layers.3.eh_proj.weight": torch.randn(64, 128)}
    assert is_mtp_tensor(hf, "model.layers.3.eh_proj.weight")
    assert not is_mtp_tensor(hf, "model.layers.2.self_attn.q_a_proj.weight")
    assert not is_mtp_tensor(hf, "model.layers.4.eh_proj.weight")
    shards = record.hf_to_megatron_shards(tensors | mtp, 0, 1, ModelChunk.whole(3))
    assert not any(".layers.3." in name for name in shards)
    with pytest.raises(ValueError, match="unknown HF tensor"):  # without MTP it is unknown
        ModelRecord(HFModelConfig.from_hf(configs["deepseek_v3"])).hf_shape(next(iter(mtp)))
    write_mtp(mtp.items(), tmp_path, config)
    back = dict(mtp_tensors(tmp_path / "mtp", hf))
    assert back.keys() == mtp.keys() and torch.equal(
        back[next(iter(mtp))], next(iter(mtp.values()))
    )
    write_mtp([("model.norm.weight", torch.ones(64))], tmp_path / "other", config)
    with pytest.raises(ValueError, match="no tensors of layers \\[3\\]"):
        mtp_tensors(tmp_path / "other" / "mtp", hf)
