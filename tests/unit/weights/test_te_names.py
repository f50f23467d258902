"""Transformer Engine's layer spec: the record's names, the fallback without TE, the GPU limits.

The fixture below lists the parameter and state-dict names megatron-core 0.16.1 gives a Qwen2
``GPTModel`` built with ``get_gpt_layer_with_transformer_engine_spec()``, written from the
sources (TE cannot be built on this CPU machine), and the whole state-dict key set (those plus
``_extra_state``); the record under ``layer_spec="te"`` must give exactly the parameter names,
and loading, streaming and exporting through them must round-trip bit-identically. The whole
key set is compared with a model megatron builds around stand-ins of TE's modules in
``tests/distributed/test_te_names_model.py``; checkpoint tolerance of ``_extra_state`` is in
``tests/distributed/checkpoint/test_te_checkpoint.py``.
"""

from __future__ import annotations

import importlib.util
import logging
import types

import pytest
import torch

from tests.unit.weights.test_record import megatron_config, qwen2_config, random_hf_state
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
    "self_attention.linear_qkv.bias",
    "mlp.linear_fc1.layer_norm_weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
)
TE_LAYER_EXTRA_STATE = (
    "self_attention.core_attention._extra_state",
    "self_attention.linear_proj._extra_state",
    "self_attention.linear_qkv._extra_state",
    "mlp.linear_fc1._extra_state",
    "mlp.linear_fc2._extra_state",
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
    layers = range(len(chunk.layers))
    params = list(TE_FIRST) if chunk.has_embedding else []
    params += [f"decoder.layers.{i}.{suffix}" for i in layers for suffix in TE_LAYER_PARAMETERS]
    extra = [f"decoder.layers.{i}.{suffix}" for i in layers for suffix in TE_LAYER_EXTRA_STATE]
    if chunk.has_output:
        tied_here = record.config.tie_word_embeddings and chunk.has_embedding
        out_params, out_extra = output_layer_names(record.head, tied_here=tied_here)
        params += list(TE_FINAL_NORM) + out_params
        extra += list(TE_FINAL_NORM_EXTRA_STATE) + out_extra
    return params, params + extra


# name -> (HF config, head): Qwen2 (QKV bias), tied and untied, policy and critic.
CASES = {
    "policy-untied": (qwen2_config(heads=4, kv_heads=2, layers=2), "lm"),
    "policy-tied": (qwen2_config(heads=4, kv_heads=2, layers=2, tied=True), "lm"),
    "critic": (qwen2_config(heads=4, kv_heads=2, layers=2, tied=True), "value"),
}
TP = 2


def te_record(case: str) -> ModelRecord:
    hf_config, head = CASES[case]
    return ModelRecord(HFModelConfig.from_hf(hf_config), head, layer_spec="te")


def fixture_chunks(record: ModelRecord, pp: int) -> list[tuple[ModelChunk, list[str]]]:
    """(chunk, the fixture's parameter names of it) for each pipeline stage."""
    config = megatron_config(record, TP, pp)
    chunks = [ModelChunk.for_stage(config, stage) for stage in range(pp)]
    return [(chunk, te_names(record, chunk)[0]) for chunk in chunks]


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_te_record_names_are_te_parameter_names(case, pp):
    record = te_record(case)
    for chunk, names in fixture_chunks(record, pp):
        assert sorted(record.tensor_maps(chunk)) == sorted(names)
        # Every other key of a TE state dict is an _extra_state: the record misses no weight.
        # The fixture's whole key set is held against a model megatron builds with the TE
        # spec in tests/distributed/test_te_names_model.py.
        _, keys = te_names(record, chunk)
        assert len(set(keys)) == len(keys)
        others = set(keys) - set(record.tensor_maps(chunk))
        assert others and all(k.endswith("._extra_state") for k in others), others


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_te_round_trip_is_bit_identical_and_matches_local(case, pp):
    record = te_record(case)
    local = ModelRecord(record.config, record.head)  # the local spec: same tensors, two renamed
    renamed = {
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    }
    hf_state = random_hf_state(record)
    back = {}
    for chunk, names in fixture_chunks(record, pp):
        shards = [record.hf_to_megatron_shards(hf_state, r, TP, chunk) for r in range(TP)]
        local_shards = [local.hf_to_megatron_shards(hf_state, r, TP, chunk) for r in range(TP)]
        for rank in range(TP):
            assert sorted(shards[rank]) == sorted(names)
            for name, tensor in shards[rank].items():
                prefix, _, suffix = name.rpartition(".layers.")
                layer, _, rest = suffix.partition(".")
                local_name = f"{prefix}.layers.{layer}.{renamed[rest]}" if rest in renamed else name
                assert torch.equal(tensor, local_shards[rank][local_name]), name
        for name in names:
            for hf_name, tensor in record.megatron_to_hf(name, [s[name] for s in shards], chunk):
                assert hf_name not in back
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
        config = megatron_config(record, TP, pp)
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


@pytest.mark.parametrize("case", list(CASES))
def test_te_named_chunk_loads_and_streams_out_exactly(case):
    # load_hf_weights and gather_hf_weights match named_parameters() against the record, as on
    # a GPU with TE: a TP=1 chunk with the fixture's names stands in for the TE model.
    record = te_record(case)
    config = megatron_config(record, 1, 1)
    ((chunk, names),) = fixture_chunks(record, 1)
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
