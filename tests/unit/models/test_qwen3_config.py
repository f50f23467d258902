"""Qwen3 / Qwen3-MoE configs: what from_hf reads and refuses; expert-parallel layout checks."""

import json

import pytest

from vapo_megatron.config.layout import ModelLayout, check_layout_pair, layout_sizes
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.tiny.model import tiny_qwen3_config, train_tokenizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["1+2=3", "Answer: 3", "12*3=36"], vocab_size=300)


def _hf(tokenizer, moe: bool, **changes) -> dict:
    config = tiny_qwen3_config(tokenizer, moe=moe).to_dict()
    config.update(changes)
    return json.loads(json.dumps(config))


def test_qwen3_reads_qk_norm_and_explicit_head_dim(tokenizer):
    hf = HFModelConfig.from_hf(_hf(tokenizer, moe=False))
    assert (hf.family, hf.qk_layernorm, hf.qkv_bias, hf.is_moe) == ("qwen3", True, False, False)
    assert hf.head_dim == 64 != hf.hidden_size // hf.num_attention_heads
    assert hf.hf_architecture("value") == "Qwen3ForSequenceClassification"


def test_qwen3_moe_reads_experts_either_key(tokenizer):
    config = _hf(tokenizer, moe=True)
    hf = HFModelConfig.from_hf(config)
    assert (hf.family, hf.num_experts, hf.moe_top_k, hf.moe_intermediate_size) == (
        "qwen3_moe", 4, 2, 32,
    )  # fmt: skip
    assert hf.is_moe and hf.norm_topk_prob and hf.qk_layernorm
    # transformers 5.x writes num_local_experts; the published checkpoints num_experts
    published = {k: v for k, v in config.items() if k != "num_local_experts"}
    published["num_experts"] = 8
    assert HFModelConfig.from_hf(published).num_experts == 8
    # transformers' default for a config without the key is False
    del published["norm_topk_prob"]
    assert not HFModelConfig.from_hf(published).norm_topk_prob


@pytest.mark.parametrize(
    "moe,change,match",
    [
        (True, {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]"),
        (True, {"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        (True, {"num_experts_per_tok": 5}, r"num_experts_per_tok=5 must be in \[1, "),
        (False, {"use_sliding_window": True}, "use_sliding_window=true"),
        (True, {"attention_bias": True}, "attention_bias=true"),
        (False, {"layer_types": ["sliding_attention", "full_attention"]}, "sliding_attention"),
        (False, {"architectures": ["Qwen3MoeForCausalLM"]}, "not supported for model_type"),
    ],
)
def test_unsupported_qwen3_configs_are_named(tokenizer, moe, change, match):
    with pytest.raises(ValueError, match=match):
        HFModelConfig.from_hf(_hf(tokenizer, moe=moe, **change))


def test_expert_layouts_are_checked(tokenizer):
    moe = HFModelConfig.from_hf(_hf(tokenizer, moe=True))
    dense = HFModelConfig.from_hf(_hf(tokenizer, moe=False))
    ModelLayout(ep=2).check(moe)
    ModelLayout(ep=2, tp=2, sequence_parallel=True).check(moe)
    ModelLayout(ep=4, tp=2, etp=1, sequence_parallel=True).check(moe)
    with pytest.raises(ValueError, match="ep=3 must divide num_experts=4"):
        ModelLayout(ep=3).check(moe)
    with pytest.raises(ValueError, match="must divide moe_intermediate_size=32"):
        ModelLayout(ep=1, etp=64).check(moe)
    with pytest.raises(ValueError, match="at tp=2 needs sequence_parallel=true"):
        ModelLayout(ep=1, tp=2).check(moe)
    with pytest.raises(ValueError, match="is a dense qwen3 model"):
        ModelLayout(ep=2).check(dense)


def test_expert_sizes_follow_megatrons_split():
    # the tp * cp * dp ranks of a stage = etp x ep x edp
    sizes = layout_sizes(tp=2, pp=2, cp=1, world_size=16, ep=4)
    assert (sizes["dp"], sizes["etp"], sizes["ep"], sizes["edp"]) == (4, 2, 4, 1)
    assert layout_sizes(tp=2, pp=1, cp=1, world_size=8, ep=4, etp=1)["edp"] == 2
    with pytest.raises(ValueError, match=r"etp \* ep = 2 \* 4 = 8 does not divide the 4 ranks"):
        layout_sizes(tp=2, pp=2, cp=1, world_size=8, ep=4)
    with pytest.raises(ValueError, match=r"policy layout: etp \* ep = 1 \* 8"):
        check_layout_pair(ModelLayout(ep=8), ModelLayout(), 4)


@pytest.mark.parametrize(
    "tp,pp,cp,world,ep,etp",
    [(1, 1, 1, 2, 2, None), (2, 1, 1, 4, 2, None), (2, 1, 1, 8, 4, 1), (2, 2, 1, 8, 2, None),
     (1, 2, 2, 8, 4, None), (2, 2, 2, 16, 2, 1), (2, 1, 1, 4, 1, 1)],
)  # fmt: skip
def test_expert_rank_groups_equal_megatrons_expert_generator(tp, pp, cp, world, ep, etp):
    from megatron.core.parallel_state import RankGenerator

    from vapo_megatron.parallel.model_groups import EXPERT_DIMS, rank_groups

    sizes = layout_sizes(tp=tp, pp=pp, cp=cp, world_size=world, ep=ep, etp=etp)
    # parallel_state.initialize_model_parallel's expert_decoder_rank_generator
    megatron = RankGenerator(
        tp=sizes["etp"], ep=ep, dp=sizes["edp"], pp=pp, cp=1, order="tp-cp-ep-dp-pp"
    )
    ours = {"tp": "etp", "ep": "ep", "dp": "edp", "pp": "pp"}
    for kind in (("ep",), ("tp",), ("tp", "ep"), ("tp", "ep", "pp"), ("dp",)):
        want = sorted(tuple(r) for r in megatron.get_ranks("-".join(kind)))
        got = rank_groups(sizes, *(ours[k] for k in kind), dims=EXPERT_DIMS)
        assert got == want, kind
    # the pipeline groups of both layouts are the same (megatron asserts it)
    assert rank_groups(sizes, "pp", dims=EXPERT_DIMS) == rank_groups(sizes, "pp")
