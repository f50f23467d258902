"""The record's Qwen3 and Qwen3-MoE rows: q/k norms, router, routed experts under both expert
schemes (SequentialMLP, TE grouped GEMM), EP index arithmetic, expert TP, the stream's EP order
and its bucket bound, and every bad layout with its message."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.weights.buckets import iter_buckets
from vapo_megatron.weights.gather import ep_hf_names
from vapo_megatron.weights.record import ModelChunk, ModelRecord
from vapo_megatron.weights.stream import stream_plan

pytestmark = pytest.mark.unit

EXPERTS, TOP_K, MOE_WIDTH, LAYERS = 8, 2, 16, 2


def qwen3_config(*, moe: bool, tied: bool = False) -> dict:
    """hidden 32 with 4 heads of head_dim 16: the query width (64) is not the hidden size."""
    config = {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if moe else "qwen3",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 200,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "dtype": "float32",
    }
    if moe:  # transformers 5.x writes num_local_experts
        config.update(
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=MOE_WIDTH,
            norm_topk_prob=True,
            mlp_only_layers=[],
            decoder_sparse_step=1,
        )
    return config


def record_of(*, moe: bool = True, scheme: str = "local", head: str = "lm") -> ModelRecord:
    hf = HFModelConfig.from_hf(qwen3_config(moe=moe))
    return ModelRecord(
        hf,
        head,
        layer_spec="local" if scheme == "local" else "te",
        grouped_experts=scheme == "grouped",
    )


def random_hf_state(record: ModelRecord, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    names = record.hf_names(ModelChunk.whole(record.config.num_layers))
    return {name: torch.randn(record.hf_shape(name), generator=gen) for name in names}


def chunk(ep_rank: int = 0, ep_size: int = 1, layers: range = range(LAYERS)) -> ModelChunk:
    return ModelChunk(
        layers=layers,
        has_embedding=layers.start == 0,
        has_output=layers.stop == LAYERS,
        ep_rank=ep_rank,
        ep_size=ep_size,
    )


def moe_config(ep: int = 1, etp: int = 1, pp: int = 1, tp: int = 1) -> TransformerConfig:
    """A TransformerConfig with megatron's expert sizes (the stream plan and for_stage read
    them); the experts' own fields do not change any name."""
    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=48,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOP_K,
        moe_ffn_hidden_size=MOE_WIDTH,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1 and ep > 1,
        pipeline_dtype=torch.float32,
        add_bias_linear=False,
        gated_linear_unit=True,
    )


# ----- names -----


def test_layer_names_under_the_three_schemes():
    """Layer 1 of a 4-expert-per-rank chunk at EP rank 1 of 2: local experts 0..3 are global
    experts 4..7. Names as megatron-core 0.16.1 registers them (SequentialMLP's
    ``local_experts.{j}`` MLPs; TE GroupedLinear's ``weight{j}``); the TE spec fuses only the
    input norm of an MoE layer."""
    hf = "model.layers.1"
    common = [
        ("self_attention.linear_qkv.weight", "self_attn.q_proj.weight"),
        ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
        ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
        ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
        ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
        ("mlp.router.weight", "mlp.gate.weight"),
    ]
    sequential = [
        (f"mlp.experts.local_experts.{j}.linear_fc{k}.weight", f"mlp.experts.{4 + j}.{p}.weight")
        for j in range(4)
        for k, p in ((1, "gate_proj"), (2, "down_proj"))
    ]
    grouped = [
        (f"mlp.experts.linear_fc{k}.weight{j}", f"mlp.experts.{4 + j}.{p}.weight")
        for j in range(4)
        for k, p in ((1, "gate_proj"), (2, "down_proj"))
    ]
    input_norm = {
        "local": ("input_layernorm.weight", "input_layernorm.weight"),
        "te": ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    }
    for scheme, experts in (("local", sequential), ("te", sequential), ("grouped", grouped)):
        maps = record_of(scheme=scheme).tensor_maps(chunk(1, 2, range(1, 2)))
        got = {
            name.removeprefix("decoder.layers.0."): m.hf_names[0].removeprefix(f"{hf}.")
            for name, m in maps.items()
            if name.startswith("decoder.layers.")
        }
        want = dict([input_norm["local" if scheme == "local" else "te"], *common, *experts])
        assert got == want, scheme
        experts_of = {m.expert for m in maps.values() if m.expert is not None}
        assert experts_of == {4, 5, 6, 7}


def test_dense_qwen3_has_q_k_norms_and_no_experts():
    record = record_of(moe=False)
    maps = record.tensor_maps(chunk())
    assert maps["decoder.layers.0.self_attention.q_layernorm.weight"].hf_names == (
        "model.layers.0.self_attn.q_norm.weight",
    )
    assert record.hf_shape("model.layers.1.self_attn.k_norm.weight") == (16,)
    assert record.hf_shape("model.layers.0.self_attn.q_proj.weight") == (64, 32)
    assert not any(m.expert is not None for m in maps.values())
    assert "decoder.layers.0.mlp.linear_fc1.weight" in maps


def test_hf_names_match_transformers_models():
    import transformers

    for moe in (False, True):
        config = qwen3_config(moe=moe)
        cls = transformers.Qwen3MoeConfig if moe else transformers.Qwen3Config
        model_cls = transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM
        hf_config = cls(**{k: v for k, v in config.items() if k not in ("architectures",)})
        with torch.device("meta"):
            model = model_cls(hf_config)
        # transformers 5.x holds experts fused in memory and saves them per expert: the
        # names on disk are the checkpoint conversion's, the ones the record reads.
        from transformers.core_model_loading import revert_weight_conversion

        on_disk = {
            name: tuple(t.shape)
            for name, t in revert_weight_conversion(model, model.state_dict()).items()
        }
        record = record_of(moe=moe)
        whole = ModelChunk.whole(LAYERS)
        assert set(record.hf_names(whole)) == set(on_disk)
        assert all(record.hf_shape(name) == shape for name, shape in on_disk.items())


# ----- EP and expert TP -----


def test_for_stage_takes_the_ep_size_and_maps_local_to_global_experts():
    config = moe_config(ep=4, etp=1)
    for ep_rank in range(4):
        got = ModelChunk.for_stage(config, 0, ep_rank=ep_rank)
        assert (got.ep_rank, got.ep_size) == (ep_rank, 4)
        assert [got.global_expert(j, EXPERTS) for j in range(2)] == [2 * ep_rank, 2 * ep_rank + 1]


@pytest.mark.parametrize("scheme", ["local", "grouped"])
@pytest.mark.parametrize("tp,ep,etp", [(1, 1, 1), (2, 2, 1), (2, 2, 2), (1, 4, 2), (2, 8, 1)])
def test_round_trip_over_tp_ep_and_expert_tp_is_bit_identical(scheme, tp, ep, etp):
    """Every (EP rank, TP rank) shard set, back to HF: each expert comes from exactly one EP
    rank, every shared tensor equally from each."""
    record = record_of(scheme=scheme)
    state = random_hf_state(record)
    back: dict[str, torch.Tensor] = {}
    for ep_rank in range(ep):
        part = chunk(ep_rank, ep)
        ranks = range(max(tp, etp))
        shards = [
            record.hf_to_megatron_shards(state, r % tp, tp, part, etp_rank=r % etp, etp_size=etp)
            for r in ranks
        ]
        for name, m in record.tensor_maps(part).items():
            size = tp if m.expert is None else etp
            want_shape = tuple(record.hf_shape(m.hf_names[0]))
            if m.expert is not None and "linear_fc1" in name:
                assert shards[0][name].shape == (2 * MOE_WIDTH // etp, want_shape[1])
            for hf_name, tensor in record.megatron_to_hf(
                name, [s[name] for s in shards[:size]], part
            ):
                if m.expert is None and hf_name in back:
                    assert torch.equal(back[hf_name], tensor), hf_name
                    continue
                assert hf_name not in back, hf_name
                back[hf_name] = tensor
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_expert_tp_splits_gate_up_like_a_dense_mlp():
    """Expert-TP rank r holds [gate_r; up_r] of its expert; fc2 its column block of down."""
    record = record_of()
    state = random_hf_state(record)
    part = chunk(1, 2)  # global experts 4..7
    shard = record.hf_to_megatron_shards(state, 0, 1, part, etp_rank=1, etp_size=2)
    fc1 = shard["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"]
    gate = state["model.layers.1.mlp.experts.6.gate_proj.weight"]
    up = state["model.layers.1.mlp.experts.6.up_proj.weight"]
    half = MOE_WIDTH // 2
    assert torch.equal(fc1, torch.cat([gate[half:], up[half:]]))
    fc2 = shard["decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"]
    assert torch.equal(fc2, state["model.layers.1.mlp.experts.6.down_proj.weight"][:, half:])


def test_ep_peers_and_the_stream_order_over_ep():
    record = record_of()
    part = chunk(0, 4)
    m = record.tensor_maps(part)["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]
    assert [peer.expert for peer in record.ep_peers(m, part)] == [1, 3, 5, 7]
    assert ep_hf_names(record, m, part) == [
        f"model.layers.0.mlp.experts.{e}.{p}.weight"
        for p in ("gate_proj", "up_proj")
        for e in (1, 3, 5, 7)
    ]
    router = record.tensor_maps(part)["decoder.layers.0.mlp.router.weight"]
    assert ep_hf_names(record, router, part) == ["model.layers.0.mlp.gate.weight"]


@pytest.mark.parametrize("ep,pp", [(1, 1), (2, 1), (4, 2)])
def test_stream_plan_lists_every_tensor_once_and_buckets_stay_bounded(ep, pp):
    """The plan over EP is the whole model, each HF tensor once; with a bucket smaller than one
    layer's experts, every bucket stays within the bound (no bucket needs a layer whole)."""
    record = record_of()
    plan = stream_plan(record, moe_config(ep=ep, etp=1, pp=pp), pp_size=pp)
    names = [name for name, _ in plan]
    assert len(names) == len(set(names))
    assert set(names) == set(record.hf_names(ModelChunk.whole(LAYERS)))
    layer_experts = 3 * EXPERTS * MOE_WIDTH * 32 * 4  # gate, up, down of each, fp32
    bound = max(t.numel() * 4 for _, t in plan)  # the largest tensor: the embedding
    assert bound < layer_experts
    buckets = list(iter_buckets(plan, bound))
    assert all(sum(t.numel() * 4 for _, t in b) <= bound for b in buckets)
    assert [name for b in buckets for name, _ in b] == names


# ----- errors -----


def test_bad_expert_layouts_and_names_raise():
    record = record_of()
    state = random_hf_state(record)
    with pytest.raises(ValueError, match="EP=3 must divide num_experts=8"):
        record.hf_to_megatron_shards(state, 0, 1, chunk(0, 3))
    with pytest.raises(ValueError, match="expert TP=3 must divide moe_intermediate_size=16"):
        record.hf_to_megatron_shards(state, 0, 1, chunk(), etp_rank=0, etp_size=3)
    with pytest.raises(ValueError, match="ep_rank=2 is not in"):
        record.hf_to_megatron_shards(state, 0, 1, chunk(2, 2))
    with pytest.raises(ValueError, match="unknown HF tensor 'model.layers.0.mlp.experts.8."):
        record.hf_shape("model.layers.0.mlp.experts.8.up_proj.weight")
    with pytest.raises(ValueError, match="on a dense qwen3 model"):
        record_of(moe=False).hf_to_megatron_shards({}, 0, 1, chunk(0, 2))
    with pytest.raises(ValueError, match="grouped_experts needs layer_spec='te'"):
        ModelRecord(record.config, grouped_experts=True)
    missing = dict(state)
    del missing["model.layers.1.mlp.experts.5.down_proj.weight"]
    with pytest.raises(ValueError, match="missing"):
        record.hf_to_megatron_shards(missing, 0, 1, chunk(1, 2))
    part = chunk(1, 2)
    name = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"
    with pytest.raises(ValueError, match="expected shape"):
        record.megatron_to_hf(name, [torch.zeros(32, MOE_WIDTH // 2)], part)
