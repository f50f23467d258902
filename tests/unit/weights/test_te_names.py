"""Transformer Engine's layer spec: the record's names, the fallback without TE, the GPU limits.

The fixture below lists the parameter and state-dict names megatron-core 0.16.1 gives a Qwen2,
Qwen3 and Qwen3-MoE ``GPTModel`` built with ``get_gpt_layer_with_transformer_engine_spec()``
(for Qwen3-MoE with TE's grouped-GEMM experts at EP 1 and 2, and with SequentialMLP experts of
TE linears), written from the sources (TE cannot be built on this CPU machine), and the whole
state-dict key set (those plus ``_extra_state``); the record under ``layer_spec="te"`` must give exactly the parameter names,
and loading, streaming and exporting through them must round-trip bit-identically. The whole
key set is compared with a model megatron builds around stand-ins of TE's modules in
``tests/distributed/test_te_names_model.py``; checkpoint tolerance of ``_extra_state`` is in
``tests/distributed/checkpoint/test_te_checkpoint.py``.
"""

from __future__ import annotations

import importlib.util
import logging
import types
from dataclasses import dataclass

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from tests.unit.weights.test_record import megatron_config, qwen2_config, random_hf_state
from tests.unit.weights.test_record_moe import qwen3_config
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.models import provider
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.weights import gather
from vapo_megatron.weights.record import ModelChunk, ModelRecord
from vapo_megatron.weights.stream import stream_plan

pytestmark = pytest.mark.unit

# ----- the fixture: what megatron-core 0.16.1 + TE name, per decoder layer -----
#
# Sources (megatron/core unless said otherwise):
# - models/gpt/gpt_layer_specs.py, get_gpt_layer_with_transformer_engine_spec (dense, no MLA):
#   no input_layernorm / pre_mlp_layernorm submodules (TransformerLayerSubmodules defaults them
#   to IdentityOp, which has no parameters); linear_qkv = TESpecProvider
#   .column_parallel_layer_norm_linear() = TELayerNormColumnParallelLinear; linear_proj =
#   TERowParallelLinear; core_attention = TEDotProductAttention; the MLP from
#   get_mlp_module_spec_for_backend: linear_fc1 = TELayerNormColumnParallelLinear (the backend
#   fuses layernorm and linear), linear_fc2 = TERowParallelLinear.
# - transformer/attention.py: Attention.__init__ builds core_attention, then linear_proj;
#   SelfAttention.__init__ then builds linear_qkv (so linear_proj's parameters come first).
#   linear_qkv has bias = add_bias_linear or add_qkv_bias (Qwen2: True); linear_proj and the
#   MLP's linears have add_bias_linear = False.
# - TransformerEngine transformer_engine/pytorch/module/layernorm_linear.py (LayerNormLinear):
#   registers "layer_norm_weight" (and "layer_norm_bias" only for LayerNorm, not RMSNorm), then
#   "weight", then "bias" when use_bias; without bias it sets a plain empty tensor attribute
#   "bias", which is neither a parameter nor a buffer. module/linear.py (Linear): the same
#   weight/bias rule.
# - TransformerEngineBaseModule.get_extra_state (module/base.py): every TE linear and TE's
#   DotProductAttention carry "_extra_state" in state_dict(); megatron's TEDotProductAttention
#   .sharded_state_dict saves only softmax_offset (learnable softmax), so core attention's
#   _extra_state never reaches a distributed checkpoint.
TE_LAYER_PARAMETERS = (
    "self_attention.linear_proj.weight",
    "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_qkv.weight",
)
TE_LAYER_EXTRA_STATE = (
    "self_attention.core_attention._extra_state",
    "self_attention.linear_proj._extra_state",
    "self_attention.linear_qkv._extra_state",
)
TE_QKV_BIAS = ("self_attention.linear_qkv.bias",)  # Qwen2 (add_qkv_bias)
TE_DENSE_MLP_PARAMETERS = (
    "mlp.linear_fc1.layer_norm_weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
)
TE_DENSE_MLP_EXTRA_STATE = ("mlp.linear_fc1._extra_state", "mlp.linear_fc2._extra_state")
# Qwen3's q/k norms:
# - gpt_layer_specs.py: q_layernorm = k_layernorm = backend.layer_norm(for_qk=True), which
#   TESpecProvider answers with TENorm (TE >= 1.9); transformer/attention.py builds each with
#   hidden_size = head_dim (kv_channels). TENorm for RMSNorm is te.pytorch.RMSNorm: "weight"
#   and an "_extra_state", as the final norm below.
TE_QK_NORM_PARAMETERS = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")
TE_QK_NORM_EXTRA_STATE = (
    "self_attention.q_layernorm._extra_state",
    "self_attention.k_layernorm._extra_state",
)
# Qwen3-MoE (num_experts set):
# - gpt_layer_specs.py: pre_mlp_layernorm = backend.layer_norm() (TENorm: "weight",
#   "_extra_state") for an MoE layer; the MLP is models/gpt/moe_module_specs.py
#   get_moe_module_spec_for_backend: MoELayer with metainfo fuse_pre_mlp_layernorm=False.
# - transformer/moe/moe_layer.py: MoELayer builds "router" (router.py TopKRouter, a
#   MegatronModule: "weight" [E, h]; no bias, no buffers without moe_router_enable_expert_bias
#   or a global aux loss; no _extra_state), then "experts" with num_local_experts = E / EP;
#   shared experts only with moe_shared_expert_intermediate_size (Qwen3-MoE has none).
# - TESpecProvider.grouped_mlp_modules: with moe_grouped_gemm, TEGroupedMLP
#   (transformer/moe/experts.py) with linear_fc1 = TEColumnParallelGroupedLinear and
#   linear_fc2 = TERowParallelGroupedLinear (extensions/transformer_engine.py), both TE's
#   GroupedLinear with num_gemms = local experts; TE 2.11 module/grouped_linear.py registers
#   "weight{i}" per GEMM ("bias{i}" only with bias; else a plain tensor attribute; megatron-core
#   0.16.1 passes no single_grouped_parameter, a TE 2.14 option) and, as every TE module, one
#   "_extra_state". Without moe_grouped_gemm: SequentialMLP, one megatron MLP per local expert
#   ("local_experts.{j}") with linear_fc1 = TEColumnParallelLinear and linear_fc2 =
#   TERowParallelLinear, each "weight" and "_extra_state".
TE_MOE_PARAMETERS = ("pre_mlp_layernorm.weight", "mlp.router.weight")
TE_MOE_EXTRA_STATE = ("pre_mlp_layernorm._extra_state",)


def te_expert_names(grouped: bool, local_experts: int) -> tuple[list[str], list[str]]:
    """(parameters, _extra_state keys) of one MoE layer's routed experts under the TE spec."""
    if grouped:
        params = [
            f"mlp.experts.linear_fc{k}.weight{j}" for k in (1, 2) for j in range(local_experts)
        ]
        return params, [f"mlp.experts.linear_fc{k}._extra_state" for k in (1, 2)]
    experts = [
        f"mlp.experts.local_experts.{j}.linear_fc{k}" for j in range(local_experts) for k in (1, 2)
    ]
    return [f"{e}.weight" for e in experts], [f"{e}._extra_state" for e in experts]


def te_layer_names(record: ModelRecord, ep_size: int) -> tuple[list[str], list[str]]:
    """(parameters, _extra_state keys) of one decoder layer under the TE spec."""
    cfg = record.config
    params, extra = list(TE_LAYER_PARAMETERS), list(TE_LAYER_EXTRA_STATE)
    if cfg.qkv_bias:
        params += TE_QKV_BIAS
    if cfg.qk_layernorm:
        params += TE_QK_NORM_PARAMETERS
        extra += TE_QK_NORM_EXTRA_STATE
    if not cfg.is_moe:
        return params + list(TE_DENSE_MLP_PARAMETERS), extra + list(TE_DENSE_MLP_EXTRA_STATE)
    expert_params, expert_extra = te_expert_names(
        record.grouped_experts, cfg.num_experts // ep_size
    )
    return (
        params + list(TE_MOE_PARAMETERS) + expert_params,
        extra + list(TE_MOE_EXTRA_STATE) + expert_extra,
    )


# Outside the layers:
# - models/common/embeddings/language_model_embedding.py: word_embeddings is
#   tensor_parallel.VocabParallelEmbedding ("weight"), whatever the layer spec.
# - transformer/transformer_block.py: a layer ModuleSpec gets layer_norm=LayerNormImpl, which is
#   TENorm when TE imports; TENorm (extensions/transformer_engine.py) returns
#   te.pytorch.RMSNorm, which in TE 2.11 (module/rmsnorm.py) is the ops RMSNorm
#   (ops/basic/rmsnorm.py: "weight"), a BasicOperation whose get_extra_state (ops/op.py) puts
#   an "_extra_state" in state_dict().
# - models/gpt/gpt_model.py: on the last stage output_layer is tensor_parallel
#   .ColumnParallelLinear under either spec, built even when it shares the embedding: then
#   (PP = 1, or a chunk that holds both) skip_weight_param_allocation leaves it without a
#   "weight", but its get_extra_state (tensor_parallel/layers.py, returns None) still puts
#   "output_layer._extra_state" in state_dict(). GPTModel.sharded_state_dict drops that key,
#   so it never reaches a distributed checkpoint.
# - The critic's output layer is the project's ValueHead ("weight"), a plain torch module:
#   no "_extra_state" (models/provider.py build_model replaces megatron's output layer).
TE_FIRST = ("embedding.word_embeddings.weight",)
TE_FINAL_NORM = ("decoder.final_layernorm.weight",)
TE_FINAL_NORM_EXTRA_STATE = ("decoder.final_layernorm._extra_state",)


def output_layer_names(head: str, *, tied_here: bool) -> tuple[list[str], list[str]]:
    """(parameters, other state-dict keys) of the last stage's output layer. ``tied_here``:
    a tied policy whose chunk also holds the embedding."""
    if head == "value":
        return ["output_layer.weight"], []
    return ([] if tied_here else ["output_layer.weight"]), ["output_layer._extra_state"]


def te_names(record: ModelRecord, chunk: ModelChunk) -> tuple[list[str], list[str]]:
    """The fixture's (parameter names, whole state-dict key set) of one chunk, local layer
    numbering."""
    layer_params, layer_extra = te_layer_names(record, chunk.ep_size)
    layers = range(len(chunk.layers))
    params = list(TE_FIRST) if chunk.has_embedding else []
    params += [f"decoder.layers.{i}.{suffix}" for i in layers for suffix in layer_params]
    extra = [f"decoder.layers.{i}.{suffix}" for i in layers for suffix in layer_extra]
    if chunk.has_output:
        tied_here = record.config.tie_word_embeddings and chunk.has_embedding
        out_params, out_extra = output_layer_names(record.head, tied_here=tied_here)
        params += list(TE_FINAL_NORM) + out_params
        extra += list(TE_FINAL_NORM_EXTRA_STATE) + out_extra
    return params, params + extra


@dataclass(frozen=True)
class Case:
    """One model of the fixture: its HF config, head, expert scheme and expert parallelism."""

    hf_config: dict
    head: str
    grouped: bool = False
    """TE's grouped-GEMM experts (TEGroupedMLP); False: SequentialMLP of TE linears."""
    ep: int = 1


# Qwen2 (QKV bias), tied and untied, policy and critic; Qwen3 (q/k norms, head_dim 16 over
# hidden 32); Qwen3-MoE (8 experts) with grouped experts at EP 1 and 2, and SequentialMLP.
CASES = {
    "policy-untied": Case(qwen2_config(heads=4, kv_heads=2, layers=2), "lm"),
    "policy-tied": Case(qwen2_config(heads=4, kv_heads=2, layers=2, tied=True), "lm"),
    "critic": Case(qwen2_config(heads=4, kv_heads=2, layers=2, tied=True), "value"),
    "qwen3": Case(qwen3_config(moe=False), "lm"),
    "qwen3-moe-grouped": Case(qwen3_config(moe=True), "lm", grouped=True),
    "qwen3-moe-grouped-ep2": Case(qwen3_config(moe=True, tied=True), "lm", grouped=True, ep=2),
    "qwen3-moe-sequential": Case(qwen3_config(moe=True), "lm"),
    "qwen3-moe-critic-ep2": Case(qwen3_config(moe=True), "value", grouped=True, ep=2),
}
TP = 2


def te_record(case: str) -> ModelRecord:
    c = CASES[case]
    hf = HFModelConfig.from_hf(c.hf_config)
    return ModelRecord(hf, c.head, layer_spec="te", grouped_experts=c.grouped)


def case_config(case: str, tp: int, pp: int) -> TransformerConfig:
    """The case's TransformerConfig at ``tp`` x ``pp`` (and its EP; megatron asks for sequence
    parallelism with EP and TP together)."""
    c = CASES[case]
    if not te_record(case).config.is_moe:
        return megatron_config(te_record(case), tp, pp)
    return megatron_config(
        te_record(case),
        tp,
        pp,
        expert_model_parallel_size=c.ep,
        sequence_parallel=tp > 1 and c.ep > 1,
    )


def fixture_chunks(case: str, pp: int, tp: int = TP) -> list[tuple[ModelChunk, list[str]]]:
    """(chunk, the fixture's parameter names of it) for each pipeline stage and EP rank."""
    record = te_record(case)
    config = case_config(case, tp, pp)
    ep = config.expert_model_parallel_size if record.config.is_moe else 1
    chunks = [
        ModelChunk.for_stage(config, stage, ep_rank=r) for stage in range(pp) for r in range(ep)
    ]
    return [(chunk, te_names(record, chunk)[0]) for chunk in chunks]


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_te_record_names_are_te_parameter_names(case, pp):
    record = te_record(case)
    for chunk, names in fixture_chunks(case, pp):
        assert sorted(record.tensor_maps(chunk)) == sorted(names)
        # Every other key of a TE state dict is an _extra_state: the record misses no weight.
        # The fixture's whole key set is held against a model megatron builds with the TE
        # spec in tests/distributed/test_te_names_model.py.
        _, keys = te_names(record, chunk)
        assert len(set(keys)) == len(keys)
        others = set(keys) - set(record.tensor_maps(chunk))
        assert others and all(k.endswith("._extra_state") for k in others), others


def test_moe_fixture_names_differ_from_the_dense_ones_where_megatron_says():
    # What the MoE cases add: the pre-MLP norm stays a module (no fused fc1 norm), the router,
    # and the grouped experts of each EP rank: local slots 0..3, global experts 4..7 on rank 1.
    chunks = fixture_chunks("qwen3-moe-grouped-ep2", 1)
    assert [chunk.ep_rank for chunk, _ in chunks] == [0, 1]
    chunk, names = chunks[1]
    layer0 = {n.removeprefix("decoder.layers.0.") for n in names if ".layers.0." in n}
    assert {"pre_mlp_layernorm.weight", "mlp.router.weight"} <= layer0
    assert not any("linear_fc1.layer_norm_weight" in n for n in names)
    experts = sorted(n for n in layer0 if "experts" in n)
    assert experts == sorted(
        f"mlp.experts.linear_fc{k}.weight{j}" for k in (1, 2) for j in range(4)
    )
    maps = te_record("qwen3-moe-grouped-ep2").tensor_maps(chunk)
    assert maps["decoder.layers.0.mlp.experts.linear_fc2.weight0"].hf_names == (
        "model.layers.0.mlp.experts.4.down_proj.weight",
    )
    qwen3 = fixture_chunks("qwen3", 1)[0][1]
    assert "decoder.layers.1.self_attention.q_layernorm.weight" in qwen3
    assert not any(n.endswith("linear_qkv.bias") for n in qwen3)


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_te_round_trip_is_bit_identical_and_matches_local(case, pp):
    """Load every (stage, EP rank, TP rank) shard under TE names, compare each with the local
    spec's tensor of the same HF tensor(s), and export back: bit-identical, every routed expert
    from exactly one EP rank, every other tensor the same on each EP rank."""
    record = te_record(case)
    local = ModelRecord(record.config, record.head)  # the local spec: same tensors, renamed
    hf_state = random_hf_state(record)
    back: dict[str, torch.Tensor] = {}
    for chunk, names in fixture_chunks(case, pp):
        shards = [record.hf_to_megatron_shards(hf_state, r, TP, chunk) for r in range(TP)]
        local_shards = [local.hf_to_megatron_shards(hf_state, r, TP, chunk) for r in range(TP)]
        local_by_hf = {m.hf_names: name for name, m in local.tensor_maps(chunk).items()}
        maps = record.tensor_maps(chunk)
        for rank in range(TP):
            assert sorted(shards[rank]) == sorted(names)
            for name, tensor in shards[rank].items():
                local_name = local_by_hf[maps[name].hf_names]
                assert torch.equal(tensor, local_shards[rank][local_name]), name
        for name in names:
            for hf_name, tensor in record.megatron_to_hf(name, [s[name] for s in shards], chunk):
                if hf_name in back:  # a tensor every EP rank holds
                    assert maps[name].expert is None and torch.equal(back[hf_name], tensor)
                back[hf_name] = tensor
    assert back.keys() == hf_state.keys()
    for name, tensor in hf_state.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize("case", list(CASES))
def test_te_stream_plan_is_the_local_one(case):
    # The stream sends HF tensors: the same names, shapes and order under either spec.
    record = te_record(case)
    local = ModelRecord(record.config, record.head)
    for pp in (1, 2):
        config = case_config(case, TP, pp)
        te_plan = [(n, tuple(t.shape)) for n, t in stream_plan(record, config, pp_size=pp)]
        local_plan = [(n, tuple(t.shape)) for n, t in stream_plan(local, config, pp_size=pp)]
        assert te_plan == local_plan
        assert sorted(n for n, _ in te_plan) == sorted(random_hf_state(record))


def module_with_parameters(named: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module tree whose named_parameters() are exactly ``named`` (a stand-in model chunk)."""
    root = torch.nn.Module()
    for name, tensor in named.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(tensor.clone()))
    return root


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c].ep == 1])
def test_te_named_chunk_loads_and_streams_out_exactly(case):
    # load_hf_weights and gather_hf_weights match named_parameters() against the record, as on
    # a GPU with TE: a TP=1 chunk with the fixture's names stands in for the TE model.
    record = te_record(case)
    config = case_config(case, 1, 1)
    ((chunk, names),) = fixture_chunks(case, 1, tp=1)
    hf_state = random_hf_state(record)
    model = module_with_parameters({n: torch.zeros(0) for n in names})
    shards = record.hf_to_megatron_shards(hf_state, 0, 1, chunk)
    for name, param in model.named_parameters():
        param.data = torch.full_like(shards[name], float("nan"))
    gather.load_hf_weights([model], record, hf_state, config, tp_rank=0, pp_rank=0)
    for name, param in model.named_parameters():
        assert torch.equal(param, shards[name]), name
    out = list(gather.gather_hf_weights([model], record, config, tp_group=None, pp_rank=0))
    assert [n for n, _ in out] == [n for n, _ in stream_plan(record, config, pp_size=1)]
    for name, tensor in out:
        assert torch.equal(tensor, hf_state[name]), name
    # The local record does not fit a TE model: a ValueError that names the cure.
    local = ModelRecord(record.config, record.head)
    with pytest.raises(ValueError, match="layer_spec_kind"):
        gather.load_hf_weights([model], local, hf_state, config, tp_rank=0, pp_rank=0)
    with pytest.raises(ValueError, match="layer_spec_kind"):
        list(gather.gather_hf_weights([model], local, config, tp_group=None, pp_rank=0))


def checkpoint_key(spec, layer_parameter: str) -> str:
    """The key a layer parameter gets in a distributed checkpoint of a model of ``spec``: its
    ``sharded_state_dict_keys_map`` applied as ``TransformerLayer.sharded_state_dict`` does
    (megatron-core 0.16.1 ``apply_prefix_mapping``, first matching prefix)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.utils import apply_prefix_mapping

    entry = {"x": ShardedObject(layer_parameter, None, (1,), (0,))}
    apply_prefix_mapping(entry, dict(spec.submodules.sharded_state_dict_keys_map))
    return entry["x"].key


@pytest.mark.parametrize("case", ["policy-untied", "qwen3", "qwen3-moe-grouped"])
def test_local_spec_checkpoint_keys_are_te_parameter_names(case):
    """The local spec's key map turns each layer parameter outside the routed experts into the
    TE spec's name of the same HF tensor(s). For an MoE layer the pre-MLP norm keeps its name:
    megatron's TE spec gives it a TENorm of its own (``fuse_pre_mlp_layernorm: False``), and
    megatron's local spec maps it to ``mlp.linear_fc1.layer_norm_`` whatever the MLP
    (``provider.moe_keys_map`` removes that entry)."""
    record = te_record(case)
    local = ModelRecord(record.config, record.head)
    spec = provider.local_spec(record.config)
    chunk = ModelChunk.whole(record.config.num_layers)
    te_by_hf = {m.hf_names: name for name, m in record.tensor_maps(chunk).items()}
    for name, m in local.tensor_maps(chunk).items():
        if m.expert is None and name.startswith("decoder.layers.0."):
            suffix = name.removeprefix("decoder.layers.0.")
            assert "decoder.layers.0." + checkpoint_key(spec, suffix) == te_by_hf[m.hf_names]


def test_te_unknown_names_still_raise():
    record = te_record("policy-untied")
    chunk = ModelChunk.whole(2)
    hf_state = random_hf_state(record)
    shards = [record.hf_to_megatron_shards(hf_state, r, TP, chunk) for r in range(TP)]
    norm = shards[0]["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"]
    for name in (
        "decoder.layers.0.input_layernorm.weight",  # the local spec's name
        "decoder.layers.0.self_attention.linear_qkv._extra_state",  # not a weight
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_bias",  # LayerNorm only
    ):
        with pytest.raises(ValueError, match="unknown Megatron tensor"):
            record.megatron_to_hf(name, [norm] * TP, chunk)
    with pytest.raises(ValueError, match="unknown HF tensor"):
        record.hf_to_megatron_shards(
            {**hf_state, "model.layers.0.extra.weight": norm}, 0, TP, chunk
        )
    model = module_with_parameters(
        {**{n: torch.zeros(0) for n in record.tensor_maps(chunk)}, "decoder.extra.weight": norm}
    )
    config = megatron_config(record, 1, 1)
    with pytest.raises(ValueError, match="model only"):
        gather.load_hf_weights([model], record, hf_state, config, tp_rank=0, pp_rank=0)
    with pytest.raises(ValueError, match="layer_spec must be"):
        ModelRecord(record.config, "lm", layer_spec="transformer_engine")


# ----- which spec a model gets, and what the local spec refuses on a GPU -----


class TEModule(torch.nn.Module):
    """TE's state protocol (TransformerEngineBaseModule / BasicOperation in TE 2.11): every
    instance puts an ``_extra_state`` (a byte tensor) in ``state_dict()``."""

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        pass


def te_linear_parameters(module, out_features, in_features, *, bias: bool) -> None:
    """TE 2.11 module/linear.py and layernorm_linear.py: "weight", then "bias" only with
    ``bias``; without it a plain empty tensor attribute named bias (not a parameter)."""
    module.weight = torch.nn.Parameter(torch.empty(out_features, in_features))
    if bias:
        module.bias = torch.nn.Parameter(torch.empty(out_features))
    else:
        module.bias = torch.empty(0)


class TELayerNormColumnParallelLinear(TEModule):
    """Stands in for megatron's wrapper of ``te.pytorch.LayerNormLinear`` with RMSNorm:
    "layer_norm_weight" first (no "layer_norm_bias" for RMSNorm), then the linear's."""

    def __init__(self, input_size, output_size, *, bias, tp_group, **_):
        super().__init__()
        self.layer_norm_weight = torch.nn.Parameter(torch.empty(input_size))
        te_linear_parameters(self, output_size // tp_group.size(), input_size, bias=bias)


class TERowParallelLinear(TEModule):
    """Stands in for megatron's wrapper of ``te.pytorch.Linear`` split along its input."""

    def __init__(self, input_size, output_size, *, bias, tp_group, **_):
        super().__init__()
        te_linear_parameters(self, output_size, input_size // tp_group.size(), bias=bias)


class TEColumnParallelLinear(TEModule):
    """Stands in for megatron's wrapper of ``te.pytorch.Linear`` split along its output (the
    SequentialMLP experts' fc1 under TE without grouped GEMM). An expert's linear splits over
    expert TP (megatron passes ``tp_group=pg_collection.expt_tp`` for ``is_expert``)."""

    def __init__(self, input_size, output_size, *, bias, tp_group, **_):
        super().__init__()
        te_linear_parameters(self, output_size // tp_group.size(), input_size, bias=bias)


class TEGroupedLinear(TEModule):
    """Stands in for megatron's ``TEGroupedLinear`` (extensions/transformer_engine.py) around
    TE 2.11's ``te.pytorch.GroupedLinear`` (module/grouped_linear.py): ``num_gemms`` weights
    "weight{i}" [out, in] (and "bias{i}" only with bias), one "_extra_state". Megatron splits
    the output (column) or input (row) over ``pg_collection.expt_tp`` itself and tells TE
    tp_size 1 when expert TP > 1 or EP > 1; at expert TP 1 there is nothing to split."""

    parallel_mode = ""

    def __init__(self, num_gemms, input_size, output_size, *, bias, pg_collection, **_):
        super().__init__()
        etp = pg_collection.expt_tp.size()
        if self.parallel_mode == "column":
            output_size //= etp
        else:
            input_size //= etp
        self.num_gemms = num_gemms
        for i in range(num_gemms):
            self.register_parameter(
                f"weight{i}", torch.nn.Parameter(torch.empty(output_size, input_size))
            )
            if bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(torch.empty(output_size)))
            else:
                setattr(self, f"bias{i}", torch.empty(0))


class TEColumnParallelGroupedLinear(TEGroupedLinear):
    """megatron's ``TEColumnParallelGroupedLinear``: the grouped experts' fc1."""

    parallel_mode = "column"


class TERowParallelGroupedLinear(TEGroupedLinear):
    """megatron's ``TERowParallelGroupedLinear``: the grouped experts' fc2."""

    parallel_mode = "row"


class TEDotProductAttention(TEModule):
    """``te.pytorch.DotProductAttention`` with vanilla softmax: no parameters, extra state."""

    def __init__(self, *_, **__):
        super().__init__()


class TENorm(TEModule):
    """What megatron's TENorm returns for RMSNorm: ``te.pytorch.RMSNorm`` ("weight")."""

    def __init__(self, config, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(hidden_size))


class FakeTESpecProvider:
    """Stands in for megatron's TESpecProvider where TE cannot be installed: megatron's own
    get_gpt_layer_with_transformer_engine_spec builds the spec's structure around stand-ins
    named like TE's classes (layer_spec_kind identifies TE's fused linear by class name) that
    register what TE 2.11's modules register, so megatron can build a model from it."""

    def __init__(self, *args, **kwargs):
        pass

    def column_parallel_linear(self):
        return TEColumnParallelLinear

    def grouped_mlp_modules(self, moe_use_grouped_gemm, moe_use_legacy_grouped_gemm):
        """TESpecProvider.grouped_mlp_modules for TE >= 1.7 (TEColumnParallelGroupedLinear
        exists): megatron's own expert modules around TE's linears."""
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

        assert not moe_use_legacy_grouped_gemm, "the legacy GroupedMLP is not TE's"
        if moe_use_grouped_gemm:
            return TEGroupedMLP, MLPSubmodules(
                linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear
            )
        return SequentialMLP, MLPSubmodules(
            linear_fc1=TEColumnParallelLinear, linear_fc2=TERowParallelLinear
        )

    def column_parallel_layer_norm_linear(self):
        return TELayerNormColumnParallelLinear

    def row_parallel_linear(self):
        return TERowParallelLinear

    def fuse_layernorm_and_linear(self):
        return True

    def core_attention(self):
        return TEDotProductAttention

    def layer_norm(self, rms_norm=False, for_qk=False):
        return TENorm

    def activation_func(self):
        return None


@pytest.fixture
def cuda_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_cuda_without_te_falls_back_to_the_local_spec(cuda_present, monkeypatch, caplog):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformer_engine" else real(name, *a),
    )
    with caplog.at_level(logging.WARNING, logger="vapo_megatron.models.provider"):
        spec = provider.default_layer_spec()
    assert provider.layer_spec_kind(spec) == "local"
    assert "transformer_engine is not installed" in caplog.text


def test_cuda_with_unusable_te_falls_back_on_megatrons_name_error(
    cuda_present, monkeypatch, caplog
):
    # TE found by importlib but not importable by megatron: megatron-core 0.16.1 then raises
    # NameError('TESpecProvider') (this machine has no TE, so the real function raises it).
    real = importlib.util.find_spec
    found = types.SimpleNamespace(name="transformer_engine")
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: found if name == "transformer_engine" else real(name, *a),
    )
    with caplog.at_level(logging.WARNING, logger="vapo_megatron.models.provider"):
        spec = provider.default_layer_spec()
    assert provider.layer_spec_kind(spec) == "local"
    assert "NameError" in caplog.text


def test_layer_spec_kind_tells_te_from_local(monkeypatch):
    from megatron.core.models.gpt import gpt_layer_specs

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", FakeTESpecProvider, raising=False)
    te_spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    assert provider.layer_spec_kind(te_spec) == "te"
    assert provider.layer_spec_kind(provider.local_spec()) == "local"
    assert provider.layer_spec_kind(gpt_layer_specs.get_gpt_layer_local_spec()) == "local"
    for grouped in (False, True):  # the MoE layer keeps its pre-MLP norm, unfused
        moe = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=8, moe_grouped_gemm=grouped, qk_layernorm=True
        )
        assert provider.layer_spec_kind(moe) == "te"
        assert provider.uses_grouped_experts(moe) == grouped
        assert moe.submodules.pre_mlp_layernorm is TENorm
        assert moe.submodules.mlp.metainfo == {"fuse_pre_mlp_layernorm": False}
    half = provider.local_spec()
    half.submodules.self_attention.submodules.linear_qkv = (
        FakeTESpecProvider().column_parallel_layer_norm_linear()
    )
    with pytest.raises(ValueError, match="parameter names"):
        provider.layer_spec_kind(half)


def test_local_attention_refusals_on_a_gpu():
    fits = provider.check_local_attention_fits
    limit = provider.LOCAL_ATTENTION_MAX_TOKENS
    assert limit == 8192
    with pytest.raises(ValueError, match="context parallelism cp=2.*transformer-engine"):
        fits("local", cp=2, on_cuda=True)
    with pytest.raises(ValueError, match=f"{limit + 1} tokens.*micro_batch_tokens"):
        fits("local", cp=1, row_tokens=limit + 1, on_cuda=True)
    fits("local", cp=1, row_tokens=limit, on_cuda=True)
    # TE's attention, and the CPU (the development path), take anything.
    fits("te", cp=4, row_tokens=22528, on_cuda=True)
    fits("local", cp=4, row_tokens=22528, on_cuda=False)


def test_build_model_refuses_context_parallelism_on_cuda_without_te(cuda_present):
    hf = HFModelConfig.from_hf(qwen2_config(layers=2))
    config = provider.transformer_config(hf, ModelLayout(cp=2), use_cpu_initialization=True)

    class Group:
        def __init__(self, size):
            self._size = size

        def size(self):
            return self._size

        def rank(self):
            return 0

    groups = types.SimpleNamespace(tp=Group(1), pp=Group(1), cp=Group(2))
    with pytest.raises(ValueError, match="context parallelism cp=2"):
        provider.build_model(
            hf, config, head="lm", pg_collection=groups, layer_spec=provider.local_spec()
        )
