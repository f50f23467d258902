"""One training step of a tiny Qwen3-MoE policy is the same at EP1, EP2 and EP2 x TP2.

``workers/moe_ep_step_worker.py`` (2 gloo ranks, ~30 s) trains the same weights on the same
mini-batch at each layout, with the plain and the distributed optimizer, and saves the reduced
gradients (HF names, gathered by the record) and the updated weights. Expert gradients travel
differently in each layout (EP1: replicated experts, reduced over DP like any weight; EP2: the
all-to-all dispatcher, megatron's expert gradient buffers reduced over expert DP; EP2 x TP2:
sequence parallelism, DP 1), so a gradient reduced over the wrong group, scaled by the wrong DP
size, or a router gradient lost in the dispatch shows as an O(1) relative difference, and an
optimizer that mishandles the expert-DP shards as weights that differ by O(lr).

Tolerances. Float32 sums in another order (the expert GEMM over another set of tokens, gloo's
reductions, TP's partial sums) differ by a few units of float32 rounding (6e-8) times the
number of terms: measured <= 1.5e-6 of each tensor's largest gradient entry, so gradients and
the step's metrics are held to 1e-5 relative. Adam's first step moves a weight by
lr * g / (|g| + eps); its slope in g is at most 1 / eps, so with the default eps = 1e-8 a
gradient entry near zero that differs in its last bits moves its weight by up to lr (with
eps 1e-8 the same gradients gave weights 9e-6 apart: Adam's amplification, not a bug). The
worker's eps = lr = 1e-3 keeps that slope at lr / eps = 1: a gradient difference of 1e-8 moves
a weight by at most 1e-8, so the updated weights are held to 1e-6 of each tensor's largest
weight (measured <= 1e-7, float32 rounding of the weights), while every tensor moved by more
than lr / 10 (measured >= 0.56 lr).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.models.workers.moe_ep_step_worker import OPTIM
from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "moe_ep_step_worker.py"
REFERENCE = "ep1/plain"
RUNS = [f"{layout}/{opt}" for layout in ("ep1", "ep2", "ep2xtp2") for opt in ("plain", "distopt")]
GRADIENT_RTOL = 1e-5
WEIGHT_RTOL = 1e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("moe_ep_step") / "runs.pt"
    run_workers(WORKER, 2, str(out), timeout=300)
    return torch.load(out, weights_only=False)


def worst_relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest max|a - b| / max|a| over the tensors (and its name)."""
    assert a.keys() == b.keys()
    return max((((a[n] - b[n]).abs().max() / a[n].abs().max()).item(), n) for n in a)


def test_every_expert_and_router_has_a_gradient(runs):
    # The comparison below means something only if tokens reached every expert.
    grads = runs[REFERENCE]["grads"]
    experts = [n for n in grads if ".mlp.experts." in n]
    routers = [n for n in grads if n.endswith(".mlp.gate.weight")]
    assert len(experts) == 2 * 4 * 3 and len(routers) == 2  # layers x experts x projections
    assert all(grads[n].abs().max() > 0 for n in experts + routers)


@pytest.mark.parametrize("run", [r for r in RUNS if r.endswith("plain") and r != REFERENCE])
def test_gradients_equal_ep1s(runs, run):
    worst, name = worst_relative(runs[REFERENCE]["grads"], runs[run]["grads"])
    assert worst <= GRADIENT_RTOL, f"{run}: {name} differs by {worst:.2e} of its largest entry"


@pytest.mark.parametrize("run", RUNS)
def test_loss_and_grad_norm_equal_ep1s_and_count_each_expert_once(runs, run):
    want, got = runs[REFERENCE]["metrics"], runs[run]["metrics"]
    for key in ("pg_loss", "grad_norm"):
        assert abs(got[key] / want[key] - 1) <= GRADIENT_RTOL, (key, got[key], want[key])
    # Megatron's norm over the ranks' shards (experts over the EP ranks that hold them) is the
    # norm of the whole gradient: the experts carry ~2% of its square here, so counting them
    # on every EP rank, or on none, would be seen.
    grads = runs[run.replace("distopt", "plain")]["grads"]
    squares = {n: float(g.double().square().sum()) for n, g in grads.items()}
    whole = sum(squares.values()) ** 0.5
    assert abs(got["grad_norm"] / whole - 1) <= GRADIENT_RTOL
    expert_share = sum(v for n, v in squares.items() if ".mlp.experts." in n) / whole**2
    assert expert_share > 100 * GRADIENT_RTOL


@pytest.mark.parametrize("run", [r for r in RUNS if r != REFERENCE])
def test_updated_weights_equal_ep1s(runs, run):
    want = runs[REFERENCE]["weights"]
    worst, name = worst_relative(want, runs[run]["weights"])
    assert worst <= WEIGHT_RTOL, f"{run}: {name} differs by {worst:.2e} of its largest weight"


def test_the_step_moved_every_tensor(runs):
    initial, updated = runs["initial"], runs[REFERENCE]["weights"]
    assert initial.keys() == updated.keys()
    moved = min((updated[n] - initial[n]).abs().max().item() for n in initial)
    assert moved > OPTIM.lr / 10, moved
