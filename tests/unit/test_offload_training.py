"""Training state off the device and back (rollout/sleep_state.py TrainingOffload): every
parameter, gradient buffer and optimizer tensor of both models returns bit-identical, in the
engine's order, and the session starts vLLM with the state already off."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.distributed.workers.train_on_worker import (
    ALGO,
    CRITIC_FIELDS,
    HF,
    POLICY_FIELDS,
    samples,
)
from tests.distributed.workers.train_step_worker import make_weights
from vapo_megatron.models.provider import ModelLayout
from vapo_megatron.parallel.cpu_shim import apply_cpu_shim
from vapo_megatron.parallel.model_groups import build_model_groups, ensure_global_memory_buffer
from vapo_megatron.rollout.sleep_state import TrainingOffload
from vapo_megatron.trainer.loss_fns import policy_loss_fn, value_loss_fn
from vapo_megatron.trainer.model_engine import ModelEngine, OptimSettings
from vapo_megatron.trainer.updates import train_on

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    apply_cpu_shim()
    yield


def trained_engines(distributed_optimizer: bool) -> tuple[ModelEngine, ModelEngine]:
    """Policy and critic after one update each: Adam state exists, gradients are non-zero."""
    optim = OptimSettings(lr=1e-3, distributed_optimizer=distributed_optimizer)
    policy_sd, critic_sd = make_weights()
    out = []
    for head, sd in (("lm", policy_sd), ("value", critic_sd)):
        groups = build_model_groups(tp=1, pp=1, cp=1)
        ensure_global_memory_buffer()
        engine = ModelEngine(HF, ModelLayout(), head=head, optim=optim, groups=groups)
        engine.load_hf(sd)
        train(engine)
        out.append(engine)
    return out[0], out[1]


def train(engine: ModelEngine) -> None:
    if engine.head == "value":
        factory, names = (lambda norm: value_loss_fn(ALGO, norm)), CRITIC_FIELDS
    else:
        factory = lambda norm: policy_loss_fn(ALGO, norm, engine.vocab_slice)  # noqa: E731
        names = POLICY_FIELDS
    train_on(engine, samples(), factory, field_names=names, token_budget=64)


def state_tensors(engine: ModelEngine) -> dict[str, torch.Tensor]:
    """Every tensor of the training state by name: parameters, main_grad, optimizer tensors."""
    out = {}
    for chunk in engine.chunks:
        for name, param in chunk.named_parameters():
            out[f"param/{name}"] = param
            out[f"main_grad/{name}"] = param.main_grad
    inners = getattr(engine.optimizer, "chained_optimizers", None) or [engine.optimizer]
    for i, inner in enumerate(inners):
        torch_opt = inner.optimizer
        for g, group in enumerate(torch_opt.param_groups):
            for j, param in enumerate(group["params"]):
                out[f"opt{i}/group{g}/main{j}"] = param
                for key, value in torch_opt.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor):
                        out[f"opt{i}/group{g}/main{j}/{key}"] = value
    return out


def is_off(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() == 0


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_round_trip_is_bit_identical_in_two_phases(distributed_optimizer):
    policy, critic = trained_engines(distributed_optimizer)
    before = {
        model: {n: t.clone() for n, t in state_tensors(e).items()}
        for model, e in (("policy", policy), ("critic", critic))
    }
    assert any(n.endswith("exp_avg_sq") for n in before["policy"])  # Adam state exists
    assert any(t.abs().sum() > 0 for n, t in before["critic"].items() if "main_grad" in n)
    offload = TrainingOffload(policy, critic)
    policy_params = {id(p) for c in policy.chunks for p in c.parameters()}

    offload.offload_for_weights()
    assert all(is_off(t) for t in state_tensors(critic).values())
    for name, tensor in state_tensors(policy).items():
        shares_params = tensor.untyped_storage().data_ptr() in {
            p.untyped_storage().data_ptr() for c in policy.chunks for p in c.parameters()
        }
        if name.startswith("param/") or shares_params:
            assert torch.equal(tensor, before["policy"][name]), name  # the sync reads these
        else:
            assert is_off(tensor), name
    first_bytes = offload.offloaded_bytes
    assert first_bytes > 0

    offload.offload_policy_params()
    assert all(is_off(t) for t in state_tensors(policy).values())
    assert all(id(p) in policy_params for c in policy.chunks for p in c.parameters())
    total = offload.offloaded_bytes
    hosts = list(offload._host)

    offload.restore()
    assert offload.offloaded_bytes == 0 and not offload.offloaded
    for model, engine in (("policy", policy), ("critic", critic)):
        after = state_tensors(engine)
        assert after.keys() == before[model].keys()
        for name, tensor in after.items():
            assert torch.equal(tensor, before[model][name]), (model, name)
        for chunk in engine.chunks:  # main_grad still views the DDP grad buffer
            grad_data = chunk.buffers[0].grad_data.untyped_storage().data_ptr()
            assert all(
                p.main_grad.untyped_storage().data_ptr() == grad_data for p in chunk.parameters()
            )

    offload.offload_all()  # a second cycle reuses the host buffers
    assert offload.offloaded_bytes == total and all(
        a is b for a, b in zip(offload._host, hosts, strict=True)
    )
    offload.restore()


def test_training_after_round_trips_equals_training_without():
    moved, kept = trained_engines(False), trained_engines(False)
    offload = TrainingOffload(*moved)
    for _ in range(2):
        offload.offload_for_weights()
        offload.offload_policy_params()
        offload.restore()
        for engine in moved:
            train(engine)
    for engine in kept:
        train(engine)
        train(engine)
    for a, b in zip(moved, kept, strict=True):
        wa, wb = dict(a.hf_weights()), dict(b.hf_weights())
        assert all(torch.equal(wa[n], wb[n]) for n in wb)


def test_session_starts_the_engine_with_the_state_off(monkeypatch):
    """vLLM sizes its memory from what is free when it starts: the state is off then, and
    comes back when the new engine goes to sleep."""
    from vapo_megatron.trainer import session

    policy, critic = trained_engines(False)
    seen = {}

    class Engine:
        def sleep(self):
            seen["asleep_with_state_off"] = all(
                is_off(t) for e in (policy, critic) for t in state_tensors(e).values()
            )
            self.training_offload.restore()

    def start(cfg, rank, *, training_offload, load_format):
        seen["off_at_start"] = all(
            is_off(t) for e in (policy, critic) for t in state_tensors(e).values()
        )
        engine = Engine()
        engine.training_offload = training_offload
        return engine

    monkeypatch.setattr(session, "start_rollout", start)
    config = SimpleNamespace(rollout=SimpleNamespace(offload_training_state=True))
    fake = SimpleNamespace(config=config, rank=0, policy=policy, critic=critic)
    engine = session.Session._start_rollout(fake)
    assert seen == {"off_at_start": True, "asleep_with_state_off": True}
    assert not engine.training_offload.offloaded
    assert not any(is_off(t) for e in (policy, critic) for t in state_tensors(e).values())


def test_without_a_critic():
    """GRPO/DAPO: the policy alone goes and comes back."""
    policy, _ = trained_engines(False)
    before = {n: t.clone() for n, t in state_tensors(policy).items()}
    offload = TrainingOffload(policy)
    offload.offload_for_weights()
    assert not all(is_off(t) for t in state_tensors(policy).values())  # params stay
    offload.offload_policy_params()
    assert all(is_off(t) for t in state_tensors(policy).values())
    offload.restore()
    assert all(torch.equal(t, before[n]) for n, t in state_tensors(policy).items())
