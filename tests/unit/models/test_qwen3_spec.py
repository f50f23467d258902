"""Qwen3 / Qwen3-MoE layer specs and TransformerConfig: what the provider builds for each."""

import json

import pytest
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.moe.moe_layer import MoELayer

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.moe import MoESettings
from vapo_megatron.models import provider
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.models.norm import RMSNorm
from vapo_megatron.tiny.model import tiny_qwen3_config, train_tokenizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def models():
    tokenizer = train_tokenizer(["1+2=3", "Answer: 3"], vocab_size=300)
    return {
        moe: HFModelConfig.from_hf(
            json.loads(tiny_qwen3_config(tokenizer, moe=moe).to_json_string())
        )
        for moe in (False, True)
    }


def test_local_spec_has_our_qk_norms_and_sequential_experts(models):
    for moe, hf in models.items():
        spec = provider.local_spec(hf)
        attention = spec.submodules.self_attention.submodules
        assert attention.q_layernorm is RMSNorm and attention.k_layernorm is RMSNorm
        assert (spec.submodules.mlp.module is MoELayer) == moe
        assert provider.layer_spec_kind(spec) == "local"
        assert not provider.uses_grouped_experts(spec)
        provider.check_spec_fits(hf, spec)
    with pytest.raises(ValueError, match="qk norms=False, MoE=False but the qwen3_moe model"):
        provider.check_spec_fits(models[True], provider.local_spec())


def test_te_moe_spec_is_te_with_its_pre_mlp_norm():
    # megatron's own spec classes; TE is not needed to build the spec objects' types here
    spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=4, qk_layernorm=True)
    assert provider.layer_spec_kind(spec) == "local"
    half = provider.local_spec()
    half.submodules.pre_mlp_layernorm = provider.IdentityOp
    with pytest.raises(ValueError, match="the model record knows"):
        provider.layer_spec_kind(half)


def test_moe_transformer_config(models):
    hf = models[True]
    config = provider.transformer_config(
        hf, ModelLayout(ep=2, tp=2, sequence_parallel=True), moe=MoESettings(aux_loss_coeff=1e-3)
    )
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (
        4,
        2,
        32,
    )
    assert config.qk_layernorm and config.kv_channels == 64 != config.hidden_size // 4
    assert config.moe_router_score_function == "softmax" and not config.moe_router_pre_softmax
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (2, 2)
    assert config.moe_router_dtype == "fp32" and config.moe_token_dispatcher_type == "alltoall"
    assert (config.moe_router_load_balancing_type, config.moe_aux_loss_coeff) == ("aux_loss", 1e-3)
    off = provider.transformer_config(hf, ModelLayout(ep=1, etp=1))
    assert off.moe_router_load_balancing_type == "none" and off.moe_z_loss_coeff is None
    unnormalised = HFModelConfig(**{**hf.__dict__, "norm_topk_prob": False})
    assert provider.transformer_config(unnormalised, ModelLayout()).moe_router_pre_softmax
    dense = provider.transformer_config(models[False], ModelLayout())
    assert dense.num_moe_experts is None and dense.qk_layernorm
    with pytest.raises(ValueError, match="moe.aux_loss_coeff=-1"):
        MoESettings(aux_loss_coeff=-1)
