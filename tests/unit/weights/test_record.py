"""The HF <-> Megatron record: config translation, TP/PP layouts, bit-exact round trips, errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.weights.record import ModelChunk, ModelRecord

pytestmark = pytest.mark.unit


def qwen2_config(*, heads=4, kv_heads=4, tied=False, vocab=250, layers=4, **extra) -> dict:
    head_dim = 8
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": heads * head_dim,
        "intermediate_size": 48,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
        "tie_word_embeddings": tied,
        "use_sliding_window": False,
        "hidden_act": "silu",
        "dtype": "float32",
        **extra,
    }


def llama_config(**extra) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 300,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        **extra,
    }


# Published configs, written by transformers 4.x (top-level rope_theta, torch_dtype).
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def random_hf_state(record: ModelRecord, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name in record.hf_names(ModelChunk.whole(record.config.num_layers)):
        shape = record.hf_shape(name)
        state[name] = torch.randn(shape, generator=gen).to(record.config.dtype)
    return state


def megatron_config(record: ModelRecord, tp: int, pp: int, **parallel) -> TransformerConfig:
    return TransformerConfig(
        **record.config.transformer_config_kwargs(),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        **parallel,
    )


def chunks_of(config: TransformerConfig) -> list[ModelChunk]:
    vp = config.virtual_pipeline_model_parallel_size
    return [
        ModelChunk.for_stage(config, pp_rank, vp_stage)
        for vp_stage in (range(vp) if vp else [None])
        for pp_rank in range(config.pipeline_model_parallel_size)
    ]


def round_trip(record, hf_state, tp, chunks) -> dict[str, torch.Tensor]:
    back: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        shards = [record.hf_to_megatron_shards(hf_state, r, tp, chunk) for r in range(tp)]
        assert [list(s) for s in shards] == [list(record.tensor_maps(chunk))] * tp
        for name in shards[0]:
            for hf_name, tensor in record.megatron_to_hf(name, [s[name] for s in shards], chunk):
                assert hf_name not in back
                back[hf_name] = tensor
    return back


ROUND_TRIP_CASES = {
    "qwen2-mha-untied": (qwen2_config(heads=4, kv_heads=4), "lm"),
    "qwen2-gqa4-tied": (qwen2_config(heads=8, kv_heads=2, tied=True), "lm"),
    "qwen2-gqa4-untied-bf16": (qwen2_config(heads=8, kv_heads=2, dtype="bfloat16"), "lm"),
    "qwen2-critic": (qwen2_config(heads=8, kv_heads=2, tied=True), "value"),
    "llama3": (llama_config(), "lm"),
}


@pytest.mark.parametrize("case", list(ROUND_TRIP_CASES))
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("pp", [1, 2])
def test_round_trip_is_bit_identical(case, tp, pp):
    hf_config, head = ROUND_TRIP_CASES[case]
    record = ModelRecord(HFModelConfig.from_hf(hf_config), head=head)
    hf_state = random_hf_state(record)
    chunks = chunks_of(megatron_config(record, tp, pp))
    back = round_trip(record, hf_state, tp, chunks)
    assert back.keys() == hf_state.keys()
    for name, tensor in hf_state.items():
        assert back[name].dtype == tensor.dtype
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize(
    "parallel",
    [
        {"virtual_pipeline_model_parallel_size": 2},
        {"num_layers_in_first_pipeline_stage": 1},
        {"num_layers_in_last_pipeline_stage": 3},
    ],
)
def test_interleaved_and_uneven_pipelines(parallel):
    record = ModelRecord(HFModelConfig.from_hf(qwen2_config(heads=8, kv_heads=2, tied=True)))
    hf_state = random_hf_state(record)
    chunks = chunks_of(megatron_config(record, 2, 2, **parallel))
    if "virtual_pipeline_model_parallel_size" in parallel:
        # Megatron's interleaving: stage 0 holds layers 0 and 2, stage 1 layers 1 and 3.
        assert [c.layers for c in chunks] == [range(i, i + 1) for i in (0, 1, 2, 3)]
        assert [(c.has_embedding, c.has_output) for c in chunks] == [
            (True, False),
            (False, False),
            (False, False),
            (False, True),
        ]
    else:
        first = parallel.get("num_layers_in_first_pipeline_stage", 1)
        assert [c.layers for c in chunks] == [range(0, first), range(first, 4)]
    # The tied copy sits on the last chunk only and exports to nothing.
    assert "output_layer.weight" in record.tensor_maps(chunks[-1])
    back = round_trip(record, hf_state, 2, chunks)
    assert back.keys() == hf_state.keys()
    assert all(torch.equal(back[n], t) for n, t in hf_state.items())


def test_layouts_match_megatron_conventions():
    """Check each split against a hand-written layout, not only against its own inverse."""
    cfg = qwen2_config(heads=8, kv_heads=2, vocab=250)
    record = ModelRecord(HFModelConfig.from_hf(cfg))
    hf = random_hf_state(record)
    hd, tp = 8, 2
    shards = [record.hf_to_megatron_shards(hf, r, tp, ModelChunk.whole(4)) for r in range(tp)]
    q = hf["model.layers.1.self_attn.q_proj.weight"].view(8, hd, -1)  # [heads, hd, hidden]
    k = hf["model.layers.1.self_attn.k_proj.weight"].view(2, hd, -1)
    v = hf["model.layers.1.self_attn.v_proj.weight"].view(2, hd, -1)
    for rank in range(tp):
        group = rank  # 2 groups over 2 ranks: one group each, its 4 query heads first
        expected = torch.cat([*q[4 * group : 4 * group + 4], k[group], v[group]])
        qkv = shards[rank]["decoder.layers.1.self_attention.linear_qkv.weight"]
        assert torch.equal(qkv, expected)
        bias = shards[rank]["decoder.layers.1.self_attention.linear_qkv.bias"]
        qb = hf["model.layers.1.self_attn.q_proj.bias"].view(8, hd)
        kb = hf["model.layers.1.self_attn.k_proj.bias"].view(2, hd)
        vb = hf["model.layers.1.self_attn.v_proj.bias"].view(2, hd)
        assert torch.equal(bias, torch.cat([*qb[4 * group : 4 * group + 4], kb[group], vb[group]]))
        gate, up = (
            hf["model.layers.1.mlp.gate_proj.weight"],
            hf["model.layers.1.mlp.up_proj.weight"],
        )
        fc1 = shards[rank]["decoder.layers.1.mlp.linear_fc1.weight"]
        assert torch.equal(
            fc1, torch.cat([gate[24 * rank : 24 * rank + 24], up[24 * rank : 24 * rank + 24]])
        )
        o = hf["model.layers.1.self_attn.o_proj.weight"]
        assert torch.equal(
            shards[rank]["decoder.layers.1.self_attention.linear_proj.weight"],
            o[:, 32 * rank : 32 * rank + 32],
        )
        assert torch.equal(
            shards[rank]["decoder.layers.1.input_layernorm.weight"],
            hf["model.layers.1.input_layernorm.weight"],
        )
    # Vocabulary 250 pads to 256 at TP=2: rank 1 holds rows 128..249 and 6 zero rows.
    emb = [s["embedding.word_embeddings.weight"] for s in shards]
    assert [tuple(e.shape) for e in emb] == [(128, 64), (128, 64)]
    assert torch.equal(emb[1][:122], hf["model.embed_tokens.weight"][128:])
    assert not emb[1][122:].any()
    assert record.config.padded_vocab_size(4) == 512
    assert record.config.padded_vocab_size(2, make_vocab_size_divisible_by=64) == 256


def test_gqa_with_tp_above_kv_heads_splits_fused_qkv_in_equal_chunks():
    """TP=4 > 2 KV heads: each group's [q(4 heads); k; v] block spans two ranks."""
    record = ModelRecord(HFModelConfig.from_hf(qwen2_config(heads=8, kv_heads=2)))
    hf = random_hf_state(record)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    full = record.hf_to_megatron_shards(hf, 0, 1, ModelChunk.whole(4))[name]
    for rank in range(4):
        shard = record.hf_to_megatron_shards(hf, rank, 4, ModelChunk.whole(4))[name]
        assert torch.equal(shard, full[24 * rank : 24 * rank + 24])


def test_streamed_input_and_shards_own_their_storage():
    record = ModelRecord(HFModelConfig.from_hf(qwen2_config(heads=8, kv_heads=2)))
    hf = random_hf_state(record)
    chunk = ModelChunk.whole(4)
    streamed = record.hf_to_megatron_shards(iter(hf.items()), 1, 2, chunk)
    from_dict = record.hf_to_megatron_shards(hf, 1, 2, chunk)
    assert all(torch.equal(streamed[n], from_dict[n]) for n in from_dict)
    for tensor in streamed.values():
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    q_k_v = record.megatron_to_hf(
        "decoder.layers.0.self_attention.linear_qkv.weight",
        [
            record.hf_to_megatron_shards(hf, r, 2, chunk)[
                "decoder.layers.0.self_attention.linear_qkv.weight"
            ]
            for r in range(2)
        ],
        chunk,
    )
    assert [n for n, _ in q_k_v] == [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"]
    for _, tensor in q_k_v:
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def test_hf_names_match_transformers_models():
    transformers = pytest.importorskip("transformers")
    cases = [
        (transformers.Qwen2Config, qwen2_config(heads=8, kv_heads=2), "Qwen2ForCausalLM", "lm"),
        (transformers.Qwen2Config, qwen2_config(tied=True), "Qwen2ForCausalLM", "lm"),
        (transformers.LlamaConfig, llama_config(), "LlamaForCausalLM", "lm"),
        (
            transformers.Qwen2Config,
            qwen2_config(heads=8, kv_heads=2, tied=True),
            "Qwen2ForSequenceClassification",
            "value",
        ),
    ]
    for config_cls, cfg, arch, head in cases:
        hf_kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
        model = getattr(transformers, arch)(config_cls(**hf_kwargs, num_labels=1))
        expected = {n: tuple(p.shape) for n, p in model.state_dict().items()}
        if cfg["tie_word_embeddings"] and head == "lm":
            del expected["lm_head.weight"]  # save_pretrained drops the tied copy
        record = ModelRecord(HFModelConfig.from_hf(cfg), head=head)
        names = record.hf_names(ModelChunk.whole(cfg["num_hidden_layers"]))
        assert {n: record.hf_shape(n) for n in names} == expected, arch
        assert record.config.hf_architecture(head) == arch


# ----- config translation -----


def test_published_qwen25_config_v4_dialect():
    cfg = HFModelConfig.from_hf(QWEN25_05B)
    assert (cfg.rope_theta, cfg.dtype, cfg.tie_word_embeddings, cfg.head_dim) == (
        1e6,
        torch.bfloat16,
        True,
        64,
    )
    kwargs = cfg.transformer_config_kwargs()
    assert kwargs["num_query_groups"] == 2 and kwargs["add_qkv_bias"] is True
    assert kwargs["layernorm_epsilon"] == 1e-6 and kwargs["normalization"] == "RMSNorm"
    gpt = cfg.gpt_model_kwargs(tp_size=2)
    assert gpt["vocab_size"] == 152064 and gpt["rotary_base"] == 1e6
    assert gpt["share_embeddings_and_output_weights"] is True
    assert "rope_scaling" not in gpt
    assert (
        cfg.gpt_model_kwargs(tp_size=2, head="value")["share_embeddings_and_output_weights"]
        is False
    )
    TransformerConfig(**kwargs, tensor_model_parallel_size=2)  # megatron accepts it


def test_v5_dialect_and_llama3_rope():
    v5 = {k: v for k, v in QWEN25_05B.items() if k not in ("rope_theta", "torch_dtype")}
    v5.update(rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, dtype="bfloat16")
    assert HFModelConfig.from_hf(v5) == HFModelConfig.from_hf(QWEN25_05B)
    llama = HFModelConfig.from_hf(llama_config())
    assert (llama.qkv_bias, llama.rope_theta, llama.llama3_rope_factor) == (False, 5e5, 8.0)
    gpt = llama.gpt_model_kwargs(tp_size=1)
    assert (gpt["rope_scaling"], gpt["rope_scaling_factor"]) == (True, 8.0)
    rope_v5 = dict(llama_config()["rope_scaling"], rope_theta=500000.0)
    v5_llama = {k: v for k, v in llama_config().items() if k not in ("rope_scaling", "rope_theta")}
    assert HFModelConfig.from_hf(dict(v5_llama, rope_parameters=rope_v5)) == llama


@pytest.mark.parametrize(
    "hf_config, message",
    [
        (dict(qwen2_config(), model_type="mistral"), "model_type 'mistral' is not supported"),
        (dict(qwen2_config(), architectures=["Qwen2MoeForCausalLM"]), "'Qwen2MoeForCausalLM'"),
        (dict(qwen2_config(), use_sliding_window=True), "use_sliding_window"),
        (llama_config(attention_bias=True), "attention_bias"),
        (llama_config(mlp_bias=True), "mlp_bias"),
        (dict(qwen2_config(), hidden_act="gelu"), "hidden_act"),
        (
            llama_config(rope_scaling=dict(llama_config()["rope_scaling"], high_freq_factor=2.0)),
            "only 'factor' may vary",
        ),
        (
            qwen2_config(rope_parameters={"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}),
            "rope_type 'yarn'",
        ),
        ({k: v for k, v in qwen2_config().items() if k != "rms_norm_eps"}, "rms_norm_eps"),
    ],
)
def test_unsupported_configs_raise(hf_config, message):
    with pytest.raises(ValueError, match=message):
        HFModelConfig.from_hf(hf_config)


# ----- errors of the record -----


@pytest.fixture
def qwen():
    record = ModelRecord(HFModelConfig.from_hf(qwen2_config(heads=8, kv_heads=2, tied=True)))
    return record, random_hf_state(record)


def test_unknown_missing_wrong_shape_and_duplicate_hf_tensors(qwen):
    record, hf = qwen
    whole = ModelChunk.whole(4)
    for extra in (
        "model.layers.0.self_attn.rotary_emb.inv_freq",
        "model.layers.4.input_layernorm.weight",
        "lm_head.weight",
    ):
        with pytest.raises(ValueError, match="unknown HF tensor"):
            record.hf_to_megatron_shards({**hf, extra: torch.zeros(64)}, 0, 1, whole)
    partial = {n: t for n, t in hf.items() if n != "model.layers.2.self_attn.v_proj.bias"}
    with pytest.raises(ValueError, match=r"1 HF tensor\(s\) missing.*v_proj.bias"):
        record.hf_to_megatron_shards(partial, 0, 1, whole)
    bad = dict(hf, **{"model.layers.3.mlp.up_proj.weight": torch.zeros(47, 64)})
    with pytest.raises(
        ValueError, match=r"up_proj.weight.*expected shape \(48, 64\), got \(47, 64\)"
    ):
        record.hf_to_megatron_shards(bad, 0, 1, whole)
    twice = [*hf.items(), ("model.norm.weight", hf["model.norm.weight"])]
    with pytest.raises(ValueError, match="given twice"):
        record.hf_to_megatron_shards(twice, 0, 1, whole)


def test_tp_and_pp_that_megatron_cannot_run_raise(qwen):
    record, hf = qwen
    with pytest.raises(ValueError, match="TP=3 does not fit"):
        record.hf_to_megatron_shards(hf, 0, 3, ModelChunk.whole(4))
    six_heads = ModelRecord(HFModelConfig.from_hf(qwen2_config(heads=6, kv_heads=3)))
    with pytest.raises(ValueError, match=r"TP=2 does not fit.*num_key_value_heads=3"):
        six_heads.hf_to_megatron_shards(random_hf_state(six_heads), 0, 2, ModelChunk.whole(4))
    with pytest.raises(ValueError, match="does not split evenly over PP=3"):
        ModelChunk.for_stage(megatron_config(record, 1, 3), pp_rank=0)
    with pytest.raises(ValueError, match="not within the model"):
        record.hf_to_megatron_shards(hf, 0, 1, ModelChunk(range(2, 6), False, True))


def test_unknown_megatron_name_and_wrong_shard_shape(qwen):
    record, hf = qwen
    whole = ModelChunk.whole(4)
    shards = record.hf_to_megatron_shards(hf, 0, 1, whole)
    with pytest.raises(ValueError, match="unknown Megatron tensor 'output_layer.weight'"):
        record.megatron_to_hf(
            "output_layer.weight", [shards["embedding.word_embeddings.weight"]], whole
        )
    with pytest.raises(ValueError, match="unknown Megatron tensor 'decoder.layers.2.input"):
        record.megatron_to_hf(
            "decoder.layers.2.input_layernorm.weight",
            [torch.zeros(64)],
            ModelChunk(range(2), True, False),
        )
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    with pytest.raises(ValueError, match=r"TP rank 1: expected shape \(48, 64\), got \(96, 64\)"):
        record.megatron_to_hf(name, [shards[name][:48], shards[name]], whole)
    critic = dataclasses.replace(record, head="value")
    [(hf_name, value_head)] = critic.megatron_to_hf(
        "output_layer.weight", [torch.ones(1, 64)] * 2, whole
    )
    assert hf_name == "score.weight" and torch.equal(value_head, torch.ones(1, 64))
