"""Training state off the device and back (engine/offload.py TrainingOffload): every
parameter and optimizer tensor of both models returns bit-identical and every gradient as
zeros (dropped, never copied), in the engine's order; the host copies live in one arena of
exactly the bytes copied, pinned once and reused; and the session starts vLLM with the state
already off."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.distributed.step.workers.train_on_worker import (
    ALGO,
    CRITIC_FIELDS,
    HF,
    POLICY_FIELDS,
    samples,
)
from tests.distributed.step.workers.train_step_worker import make_weights
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.engine.offload import TrainingOffload
from vapo_megatron.parallel.cpu_shim import apply_cpu_shim
from vapo_megatron.parallel.model_groups import build_model_groups, ensure_global_memory_buffer
from vapo_megatron.rollout.sleep_state import EngineStateError
from vapo_megatron.step.losses import policy_loss_fn, value_loss_fn
from vapo_megatron.step.updates import train_on

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    apply_cpu_shim()
    yield


def trained_engines(
    distributed_optimizer: bool, *, trained: bool = True
) -> tuple[ModelEngine, ModelEngine]:
    """Policy and critic after one update each (Adam state exists, gradients are non-zero), or
    before any (``trained=False``: no Adam moments yet)."""
    optim = OptimSettings(lr=1e-3, distributed_optimizer=distributed_optimizer)
    policy_sd, critic_sd = make_weights()
    out = []
    for head, sd in (("lm", policy_sd), ("value", critic_sd)):
        groups = build_model_groups(tp=1, pp=1, cp=1)
        ensure_global_memory_buffer()
        engine = ModelEngine(HF, ModelLayout(), head=head, optim=optim, groups=groups)
        engine.load_hf(sd)
        if trained:
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


def is_grad(name: str) -> bool:
    return name.startswith("main_grad/")


def grad_tensors(engine: ModelEngine) -> list[torch.Tensor]:
    """Every gradient: the DDP grad buffers, main_grad, the optimizer's main parameters' .grad."""
    out = [buffer.grad_data for chunk in engine.chunks for buffer in chunk.buffers]
    out += [t for n, t in state_tensors(engine).items() if is_grad(n)]
    inners = getattr(engine.optimizer, "chained_optimizers", None) or [engine.optimizer]
    params = [p for inner in inners for g in inner.optimizer.param_groups for p in g["params"]]
    return out + [p.grad for p in params if p.grad is not None]


def kept_tensors(engine: ModelEngine) -> list[torch.Tensor]:
    """Every tensor that must survive: parameters, module buffers, optimizer tensors."""
    out = [t for n, t in state_tensors(engine).items() if not is_grad(n)]
    return out + [b for chunk in engine.chunks for b in torch.nn.Module.buffers(chunk)]


def storage_bytes(tensors) -> dict[int, int]:
    """nbytes of each distinct storage, by its address."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def state_bytes(*engines: ModelEngine) -> tuple[int, int]:
    """(bytes that must be copied, gradient bytes that need not), over distinct storages."""
    kept = storage_bytes(t for e in engines for t in kept_tensors(e))
    grads = storage_bytes(t for e in engines for t in grad_tensors(e))
    return sum(kept.values()), sum(n for ptr, n in grads.items() if ptr not in kept)


def round_trip(offload: TrainingOffload) -> None:
    offload.offload_for_weights()
    offload.offload_policy_params()
    offload.restore()


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_round_trip_keeps_the_state_and_zeroes_the_gradients(distributed_optimizer):
    policy, critic = trained_engines(distributed_optimizer)
    before = {
        model: {n: t.clone() for n, t in state_tensors(e).items()}
        for model, e in (("policy", policy), ("critic", critic))
    }
    assert any(n.endswith("exp_avg_sq") for n in before["policy"])  # Adam state exists
    assert any(t.abs().sum() > 0 for n, t in before["critic"].items() if is_grad(n))
    copied, dropped = state_bytes(policy, critic)
    offload = TrainingOffload(policy, critic)
    policy_params = {id(p) for c in policy.chunks for p in c.parameters()}
    param_storages = {p.untyped_storage().data_ptr() for c in policy.chunks for p in c.parameters()}

    offload.offload_for_weights()
    assert all(is_off(t) for t in state_tensors(critic).values())
    assert all(is_off(t) for e in (policy, critic) for t in grad_tensors(e))
    for name, tensor in state_tensors(policy).items():
        if name.startswith("param/") or tensor.untyped_storage().data_ptr() in param_storages:
            assert torch.equal(tensor, before["policy"][name]), name  # the sync reads these
        else:
            assert is_off(tensor), name
    assert offload.dropped_bytes == dropped > 0
    assert 0 < offload.offloaded_bytes < copied

    offload.offload_policy_params()
    assert all(is_off(t) for t in state_tensors(policy).values())
    assert all(id(p) in policy_params for c in policy.chunks for p in c.parameters())
    assert offload.offloaded_bytes == offload.arena.nbytes == copied  # no gradient byte copied

    offload.restore()
    assert offload.offloaded_bytes == offload.dropped_bytes == 0 and not offload.offloaded
    for model, engine in (("policy", policy), ("critic", critic)):
        after = state_tensors(engine)
        assert after.keys() == before[model].keys()
        for name, tensor in after.items():
            if is_grad(name):
                assert not tensor.any(), (model, name)  # back as zeros: the update zeroes them
            else:
                assert torch.equal(tensor, before[model][name]), (model, name)
        for chunk in engine.chunks:  # main_grad still views the DDP grad buffer
            grad_data = chunk.buffers[0].grad_data.untyped_storage().data_ptr()
            assert all(
                p.main_grad.untyped_storage().data_ptr() == grad_data for p in chunk.parameters()
            )


class FakeCudart:
    """torch.cuda.cudart() on a machine without CUDA: records what would be pinned."""

    def __init__(self):
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 (CUDA's name)
        self.registered.append((ptr, nbytes))
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def test_one_exact_pinned_arena_reused_grown_once_and_released(monkeypatch):
    """Pinned through cudaHostRegister, not torch's power-of-two caching host allocator: one
    allocation of exactly the bytes copied (no gradient bytes), reused by later round trips;
    a new exact one (the old unpinned first) only when Adam's moments appear; freed at release."""
    from vapo_megatron.engine import host_arena

    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    asked = []
    real = host_arena.allocate_host

    def recording(nbytes, *, pin):
        asked.append(nbytes)
        return real(nbytes, pin=pin)

    monkeypatch.setattr(host_arena, "allocate_host", recording)
    policy, critic = trained_engines(True, trained=False)  # no Adam moments yet
    offload = TrainingOffload(policy, critic, pin_memory=True)
    before_update = state_bytes(policy, critic)[0]
    round_trip(offload)
    round_trip(offload)
    assert asked == [before_update] and cudart.registered[0][1] == before_update
    assert not cudart.unregistered

    train(policy), train(critic)
    copied, dropped = state_bytes(policy, critic)
    assert copied > before_update and dropped > 0
    for _ in range(2):
        offload.offload_all()
        assert offload.offloaded_bytes == offload.arena.nbytes == copied
        assert offload.dropped_bytes == dropped
        offload.restore()
    assert asked == [before_update, copied]  # grown once, then reused
    assert [n for _, n in cudart.registered] == asked
    assert cudart.unregistered == [cudart.registered[0][0]]  # the first one, before the second

    offload.offload_for_weights()
    with pytest.raises(EngineStateError, match="restore"):
        offload.release()  # would lose the state on the host
    offload.offload_policy_params()
    offload.restore()
    offload.release()
    assert cudart.unregistered == [ptr for ptr, _ in cudart.registered]
    assert offload.arena.nbytes == 0


def test_without_cuda_the_arena_is_not_pinned(monkeypatch):
    """The CPU path: no CUDA call at all (pin_memory defaults to CUDA's availability)."""

    def no_cuda():
        raise AssertionError("torch.cuda.cudart() called without CUDA")

    monkeypatch.setattr(torch.cuda, "cudart", no_cuda)
    policy, critic = trained_engines(False)
    offload = TrainingOffload(policy, critic)
    assert not offload.pin_memory
    round_trip(offload)
    offload.release()


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_training_after_round_trips_equals_training_without(distributed_optimizer):
    """Each update accumulates over several micro-batches (token_budget 64) and starts from
    the zeros the dropped gradients came back as: the same weights and Adam state as without."""
    moved = trained_engines(distributed_optimizer)
    kept = trained_engines(distributed_optimizer)
    offload = TrainingOffload(*moved)
    for _ in range(2):
        round_trip(offload)
        for engine in moved:
            train(engine)
    for engine in kept:
        train(engine)
        train(engine)
    for a, b in zip(moved, kept, strict=True):
        wa, wb = dict(a.hf_weights()), dict(b.hf_weights())
        assert all(torch.equal(wa[n], wb[n]) for n in wb)
        sa, sb = state_tensors(a), state_tensors(b)
        assert all(torch.equal(sa[n], sb[n]) for n in sb if not n.startswith("param/"))


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
    for name, tensor in state_tensors(policy).items():
        assert not tensor.any() if is_grad(name) else torch.equal(tensor, before[name]), name
