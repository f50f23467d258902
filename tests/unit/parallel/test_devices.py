"""Tensors are made on their inputs' device (a CPU tensor in a CUDA step fails, or NCCL does).

Two checks, because no CUDA device is here:
- functions that never need a Python value from the data run with every input on the
  ``meta`` device, and every output must be on ``meta`` (a tensor made on the CPU either
  raises when mixed in, or leaves its result on the CPU);
- GAE needs data-dependent values (``.item()`` for the reward check and the run layout,
  ``nonzero``), which meta tensors cannot give, so it runs on the CPU under a torch-function
  mode that records every factory call (arange, zeros, full, ...) made without ``device=``.
With CUDA (``-m gpu``), everything also runs on ``cuda`` and the outputs must stay there.
"""

from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from vapo_megatron.algorithms.advantages import (
    decoupled_gae_packed,
    decoupled_gae_padded,
    gae_lambdas,
)
from vapo_megatron.algorithms.gae import (
    gae_packed,
    gae_padded,
    length_adaptive_lambda,
    reverse_discounted_cumsum,
)
from vapo_megatron.algorithms.group_advantages import (
    dynamic_sampling_keep,
    group_normalized_advantages,
    soft_overlong_penalty,
)
from vapo_megatron.algorithms.losses import (
    aggregate,
    entropy_bonus,
    explained_variance,
    explained_variance_stats,
    policy_loss,
    positive_nll_loss,
    value_loss,
)
from vapo_megatron.algorithms.presets import algo_preset
from vapo_megatron.parallel import cp_gae
from vapo_megatron.parallel.reductions import global_loss_normalisers

pytestmark = pytest.mark.unit

FACTORIES = {
    torch.arange, torch.empty, torch.eye, torch.full, torch.linspace, torch.ones, torch.rand,
    torch.randint, torch.randn, torch.scalar_tensor, torch.tensor, torch.zeros, torch.as_tensor,
}  # fmt: skip


class DevicelessFactoryCalls(TorchFunctionMode):
    """Records torch factory calls that pass no ``device=`` (they land on the CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            self.calls.append(f"torch.{func.__name__}{tuple(args)!r}")
        return func(*args, **kwargs)


def outputs(tree):
    """Every tensor in nested tuples / lists / dicts / dataclass-like objects."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            yield from outputs(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from outputs(item)
    elif hasattr(tree, "__dict__"):
        yield from outputs(vars(tree))


def loss_calls(device):
    """(name, thunk) for every loss, group-advantage and lambda function, inputs on device."""
    shape = (3, 5)
    x = torch.randn(shape, device=device)
    logprobs = torch.randn(shape, device=device, requires_grad=True)
    mask = torch.ones(shape, dtype=torch.bool, device=device)
    seq_tokens = torch.full(shape, 5.0, device=device)
    count = torch.tensor(15.0, dtype=torch.float64, device=device)
    scores = torch.randn(8, device=device)
    lengths = torch.arange(4, device=device) * 30
    calls = [
        ("aggregate", lambda: aggregate(x, mask, "token-mean", num_tokens=count)),
        (
            "aggregate seq-mean",
            lambda: aggregate(
                x, mask, "seq-mean-token-mean", num_tokens=15, num_seqs=3, seq_num_tokens=seq_tokens
            ),
        ),
        (
            "policy_loss",
            lambda: policy_loss(
                logprobs,
                x + 0.1,
                x,
                mask,
                eps_low=0.2,
                eps_high=0.28,
                aggregation="token-mean",
                num_tokens=count,
                dual_clip=3.0,
            ),
        ),
        (
            "policy_loss no dual",
            lambda: policy_loss(
                logprobs,
                x,
                x,
                mask,
                eps_low=0.2,
                eps_high=0.2,
                aggregation="seq-mean-token-sum",
                num_tokens=15,
                num_seqs=3,
            ),
        ),
        ("value_loss", lambda: value_loss(x, x + 1, mask, num_tokens=15)),
        (
            "value_loss clip",
            lambda: value_loss(x, x + 1, mask, num_tokens=count, old_values=x + 0.5, clip=0.2),
        ),
        ("positive_nll_loss", lambda: positive_nll_loss(x, mask, mask, num_positive_tokens=15)),
        ("entropy_bonus", lambda: entropy_bonus(x, mask, num_tokens=count)),
        ("explained_variance_stats", lambda: explained_variance_stats(x, x + 1, mask)),
        ("explained_variance", lambda: explained_variance(explained_variance_stats(x, x, mask))),
        ("group_normalized_advantages", lambda: group_normalized_advantages(scores, 4)),
        ("group mean only", lambda: group_normalized_advantages(scores, 4, scale_by_std=False)),
        ("dynamic_sampling_keep", lambda: dynamic_sampling_keep(scores, 4)),
        ("soft_overlong_penalty", lambda: soft_overlong_penalty(lengths, 60, 20)),
        ("length_adaptive_lambda", lambda: length_adaptive_lambda(lengths, 0.05)),
        (
            "reverse_discounted_cumsum",
            lambda: reverse_discounted_cumsum(
                torch.randn(3, 40, device=device), torch.rand(3, device=device)
            ),
        ),  # fmt: skip
        (
            "global_loss_normalisers",
            lambda: global_loss_normalisers(
                [mask, mask[:1]],
                [mask, ~mask[:1]],
                4,
                dp_cp_group=None,
                cp_size=1,
                device=mask.device,
            ),
        ),
    ]
    for preset in ("vapo", "ppo", "vc_ppo", "orz"):
        calls.append(
            (f"gae_lambdas {preset}", lambda p=preset: gae_lambdas(algo_preset(p), lengths))
        )
    return calls


def gae_calls(device):
    """(name, thunk) for every GAE entry point (they read data-dependent values)."""
    gen = torch.Generator().manual_seed(0)
    batch, length = 4, 24
    values = torch.randn(batch, length, generator=gen).to(device)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[0, 3:20] = True
    mask[1] = torch.rand(length, generator=gen) > 0.5  # several runs: the compacted path
    mask[3, 8:] = True
    rewards = torch.zeros(batch, length)
    rewards[0, 19] = rewards[3, 23] = 1.0
    one_run = mask.clone()
    one_run[1] = False
    mask, one_run, rewards = mask.to(device), one_run.to(device), rewards.to(device)
    lam = torch.rand(batch, generator=gen, dtype=torch.float64).to(device)
    cu = (torch.arange(batch + 1) * length).to(device)
    flat = [t.reshape(-1) for t in (rewards, values, mask)]
    cfg = algo_preset("vapo")
    return [
        ("gae_padded", lambda: gae_padded(rewards, values, mask, lam)),
        ("gae_padded one run per row", lambda: gae_padded(rewards, values, one_run, 0.9)),
        ("gae_packed", lambda: gae_packed(*flat, cu, lam, 0.99)),
        ("gae_packed cu on cpu", lambda: gae_packed(*flat, cu.cpu(), lam, 0.99)),
        ("decoupled_gae_padded", lambda: decoupled_gae_padded(cfg, rewards, values, mask)),
        ("decoupled_gae_packed", lambda: decoupled_gae_packed(cfg, *flat, cu)),
        (
            "decoupled_gae_packed ppo",
            lambda: decoupled_gae_packed(algo_preset("ppo"), *flat, cu.cpu()),
        ),
        (
            "gae_context_parallel",
            lambda: cp_gae.gae_context_parallel(
                *[t.reshape(2, 2 * length) for t in (rewards, values, mask)], lam[:2], 1.0, None
            ),
        ),  # fmt: skip
        (
            "gae_context_parallel_packed",
            lambda: cp_gae.gae_context_parallel_packed(*flat, cu, lam, 1.0, None),
        ),  # fmt: skip
    ]


def fake_cp_group(monkeypatch, size: int) -> object:
    """Make cp_gae see a CP group of ``size`` (this rank 0) whose all-gather repeats this
    rank's summary: the numbers are not a real CP result (the gloo tests check those), but
    every line of the multi-rank path runs."""

    def all_gather(tensor, group):
        return [tensor.clone() for _ in range(size)]

    fake = SimpleNamespace(get_world_size=lambda group: size, get_rank=lambda group: 0)
    monkeypatch.setattr(cp_gae, "dist", fake)
    monkeypatch.setattr(cp_gae, "collectives", SimpleNamespace(all_gather=all_gather))
    return object()


@pytest.mark.parametrize("name", [name for name, _ in loss_calls("meta")])
def test_losses_and_normalisers_stay_on_the_inputs_device(name):
    for tensor in outputs(dict(loss_calls("meta"))[name]()):
        assert tensor.device.type == "meta", f"{name} returned a tensor on {tensor.device}"


@pytest.mark.parametrize("name", [name for name, _ in gae_calls("cpu")])
def test_gae_makes_no_tensor_without_a_device(name):
    call = dict(gae_calls("cpu"))[name]
    with DevicelessFactoryCalls() as recorder:
        call()
    assert not recorder.calls, f"{name} made tensors without device=: {recorder.calls}"


def test_cp_gae_multi_rank_path_makes_no_tensor_without_a_device(monkeypatch):
    group = fake_cp_group(monkeypatch, 2)
    gen = torch.Generator().manual_seed(1)
    rewards, values = torch.zeros(3, 8), torch.randn(3, 8, generator=gen)
    mask = torch.rand(3, 8, generator=gen) > 0.3
    cu = torch.tensor([0, 8, 16, 24])  # full padded sequences of 8 = 4 chunks of 2 at CP=2
    with DevicelessFactoryCalls() as recorder:
        adv, ret = cp_gae.gae_context_parallel(rewards, values, mask, 0.9, 1.0, group)
        cp_gae.gae_context_parallel_packed(
            rewards.reshape(-1)[:12], values.reshape(-1)[:12], mask.reshape(-1)[:12], cu,
            0.9, 1.0, group,
        )  # fmt: skip
    assert not recorder.calls, recorder.calls
    assert adv.shape == ret.shape == (3, 8)


def test_the_recorder_can_fail():
    with DevicelessFactoryCalls() as recorder:
        torch.arange(3)
        torch.zeros(2, device="cpu")
    assert recorder.calls == ["torch.arange(3,)"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_everything_stays_on_cuda():
    for name, call in loss_calls("cuda") + gae_calls("cuda"):
        for tensor in outputs(call()):
            assert tensor.device.type == "cuda", f"{name} returned a tensor on {tensor.device}"
