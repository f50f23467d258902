"""CPU twins of GPU-only behaviour at the device boundary.

- A host tensor in a collective of a NCCL group: NCCL rejects it at run time on a GPU; here
  the group's backend is reported as NCCL (monkeypatched) and the project's collectives must
  refuse the tensor with a message that names the fix, before torch is reached.
- Object collectives on a NCCL group stage on the GPU: refused.
- ``MicroBatch.to`` moves every tensor (``meta`` stands for the GPU: a tensor left behind
  stays on the CPU and shows), cu_seqlens as int32.
- The trainer's engines start from dummy weights, evaluation's from the checkpoint; the
  default group gets the recipe's timeout; the value head is made on megatron's init device.
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from vapo_megatron.data.packing import Sample, pack, pad
from vapo_megatron.models.value_head import ValueHead
from vapo_megatron.parallel import collectives, devices

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield


@pytest.fixture
def nccl(monkeypatch):
    """Every group reports NCCL, and the current CUDA device is 0 (nothing is allocated)."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_group_device_follows_the_backend(nccl):
    assert collectives.group_device(None) == torch.device("cuda", 0)


def test_group_device_is_the_host_on_gloo():
    assert collectives.group_device(None) == torch.device("cpu")


@pytest.mark.parametrize(
    "call",
    [
        lambda t: collectives.all_reduce(t, None),
        lambda t: collectives.all_gather_varlen(t, None),
        lambda t: collectives.broadcast(t, src=0, group=None),
        lambda t: collectives.send(t, dst=0),
        lambda t: collectives.recv(t, src=0),
        lambda t: collectives.gather(t, None, dst=0, group=None),
        lambda t: collectives.all_gather_into_tensor(t, t, None),
        lambda t: collectives.all_to_all_flat(t, [3], None),
    ],
)
def test_host_tensor_into_nccl_group_is_refused(nccl, call):
    with pytest.raises(ValueError, match=r"tensor on cpu went to a collective of a nccl group"):
        call(torch.zeros(3, device="cpu"))


@pytest.mark.parametrize(
    "call",
    [
        lambda: collectives.all_gather_objects({"a": 1}, None),
        lambda: collectives.broadcast_object({"a": 1}, None),
    ],
)
def test_object_collectives_refuse_nccl(nccl, call):
    with pytest.raises(ValueError, match="gloo"):
        call()


def test_host_group_collectives_work_on_one_rank():
    host = collectives.make_host_group(timedelta(minutes=1))
    assert dist.get_backend(host) == "gloo"
    assert collectives.all_gather_objects({"a": 1}, host) == [{"a": 1}]
    assert collectives.broadcast_object("x", host) == "x"
    counts = torch.ones(2, device="cpu")
    collectives.all_reduce(counts, host)
    assert counts.tolist() == [1.0, 1.0]


def test_all_to_all_flat_refuses_sizes_that_do_not_cover_the_buffer():
    x = torch.arange(4, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"one size per rank \(1\) summing to its length 4"):
        collectives.all_to_all_flat(x, [3], None)
    with pytest.raises(ValueError, match="one size per rank"):
        collectives.all_to_all_flat(x, [2, 2], None)
    got = collectives.all_to_all_flat(x, [4], None)
    assert torch.equal(got[0], x) and got[0].data_ptr() != x.data_ptr()


def samples():
    return [
        Sample(prompt=[1, 2], response=[3, 4, 5], fields={"adv": torch.ones(3, device="cpu")}),
        Sample(prompt=[6], response=[7], fields={"adv": torch.ones(1, device="cpu")}),
    ]


@pytest.mark.parametrize("make", [pack, pad])
def test_micro_batch_to_moves_every_tensor(make):
    mb = make(samples(), cp_size=2, cp_rank=1)
    moved = mb.to(torch.device("meta"))
    tensors = [moved.tokens, moved.labels, moved.response_mask]
    if make is pack:  # packed rows carry no position ids (MicroBatch.position_ids)
        assert mb.position_ids is None and moved.position_ids is None
    else:
        tensors.append(moved.position_ids)
    tensors += list(moved.fields.values())
    params = moved.packed_seq_params
    if params is not None:
        cu = [params.cu_seqlens_q, params.cu_seqlens_kv]
        cu += [params.cu_seqlens_q_padded, params.cu_seqlens_kv_padded]
        assert all(c.dtype == torch.int32 for c in cu)
        tensors += cu
        assert params.max_seqlen_q == mb.packed_seq_params.max_seqlen_q
    assert all(t.device.type == "meta" for t in tensors)
    assert moved.seq_length == mb.seq_length and moved.num_seqs == mb.num_seqs
    assert mb.tokens.device.type == "cpu"  # the host copy is left as it was
    assert moved.tokens.dtype == moved.labels.dtype == torch.long  # what the model indexes with


@pytest.mark.parametrize("make", [pack, pad])
def test_micro_batch_ids_cross_as_int32(make, monkeypatch):
    """Token ids and labels leave the host as int32 and are widened on the device: a
    recorder of every ``Tensor.to`` a move makes sees no int64 row cross."""
    mb = make(samples(), cp_size=1, cp_rank=0)
    crossed, original = [], torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if out.device.type == "meta" and self.device.type == "cpu":
            crossed.append((self.dtype, tuple(self.shape)))
        return out

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    moved = mb.to(torch.device("meta"))
    row = tuple(mb.tokens.shape)
    assert [dtype for dtype, shape in crossed if shape == row].count(torch.int32) == 2
    positions = 0 if make is pack else 1  # padded rows' positions (an expanded arange)
    assert crossed.count((torch.long, row)) == positions
    assert moved.tokens.dtype == moved.labels.dtype == torch.long


def test_value_head_is_made_on_the_given_device():
    head = ValueHead(8, sequence_parallel=False, tp_group=None, device=torch.device("meta"))
    assert head.weight.device.type == "meta"


def test_init_device_follows_megatron(monkeypatch):
    assert devices.init_device(True) == torch.device("cpu")
    assert devices.init_device(False) == torch.device("cpu")  # no CUDA here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert devices.init_device(False) == torch.device("cuda", 3)
    assert devices.init_device(True) == torch.device("cpu")


def test_trainer_engines_start_from_dummy_weights(monkeypatch):
    import inspect

    from vapo_megatron.trainer import evaluation, session

    default = inspect.signature(session.start_rollout).parameters["load_format"].default
    recorded = {}
    monkeypatch.setattr(session, "start_rollout", lambda cfg, rank, **kw: recorded.update(kw))
    config = SimpleNamespace(rollout=SimpleNamespace(offload_training_state=False))
    session.Session._start_rollout(SimpleNamespace(config=config, rank=0))
    assert recorded["load_format"] == "dummy"
    # Evaluation of a saved model reads its weights: start_rollout's default, not overridden.
    assert default == "auto"
    assert "load_format" not in inspect.getsource(evaluation.EvalSession.__init__)


def test_init_distributed_passes_the_timeout(monkeypatch):
    from vapo_megatron.trainer import session

    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: seen.update(kw))
    monkeypatch.setenv("RANK", "0")
    session.init_distributed(timedelta(minutes=60))
    assert seen["timeout"] == timedelta(minutes=60)


def test_engine_refuses_a_long_row_on_a_gpu_without_te(monkeypatch):
    """The local spec's dense attention on a GPU: ``ModelEngine.run`` checks each call's rows
    before anything reaches the model (CUDA reported present only after the engine is built)."""
    from vapo_megatron.config.layout import ModelLayout
    from vapo_megatron.config.optim import OptimSettings
    from vapo_megatron.engine.model_engine import ModelEngine
    from vapo_megatron.models.config import HFModelConfig
    from vapo_megatron.models.provider import LOCAL_ATTENTION_MAX_TOKENS
    from vapo_megatron.parallel.cpu_shim import apply_cpu_shim
    from vapo_megatron.parallel.model_groups import build_model_groups, ensure_global_memory_buffer
    from vapo_megatron.step.losses import value_scoring_fn

    apply_cpu_shim()
    hf = HFModelConfig.from_hf(
        {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "vocab_size": 64, "max_position_embeddings": 16384, "rms_norm_eps": 1e-6,
         "rope_theta": 1e6, "tie_word_embeddings": False}
    )  # fmt: skip
    groups = build_model_groups(tp=1, pp=1, cp=1)
    ensure_global_memory_buffer()
    engine = ModelEngine(hf, ModelLayout(), head="value", optim=OptimSettings(), groups=groups)
    long = pack([Sample(prompt=[1] * LOCAL_ATTENTION_MAX_TOKENS, response=[2])])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="local spec's dense attention"):
        engine.run([long], value_scoring_fn(), forward_only=True)


def test_engine_refuses_a_model_that_reads_position_ids():
    from types import SimpleNamespace

    from vapo_megatron.engine.model_engine import _check_positions_unused

    _check_positions_unused(SimpleNamespace(position_embedding_type="rope", mtp_process=False))
    for model in (
        SimpleNamespace(position_embedding_type="learned_absolute", mtp_process=False),
        SimpleNamespace(position_embedding_type="mrope", mtp_process=False),
        SimpleNamespace(position_embedding_type="rope", mtp_process=True),
    ):
        with pytest.raises(ValueError, match="packed micro-batches give no position ids"):
            _check_positions_unused(model)
