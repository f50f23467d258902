"""One training step of a tiny DeepSeek-V3 policy (MLA, a dense first layer, a shared expert,
sigmoid routing with a non-zero expert bias) is the same at EP1, TP2 and TP2 x EP2 (sequence
parallelism at TP 2): ``workers/moe_ep_step_worker.py deepseek_v3`` (2 gloo ranks, ~30 s),
the tolerances of ``test_moe_ep_step.py`` (its docstring has the reasoning).

What it holds: under the local spec megatron-core 0.16.1 gathers MLA's column-parallel
``[kv latent | RoPE key]`` over TP and uses the RoPE key whole on every rank, each for its own
heads, and its gather's backward keeps each rank's own columns, so the key's weight rows got
only one rank's heads' gradient: TP 2's step differed from TP 1's by 1.9e-3 at lr 1e-3 while
the forward logits were equal (``models/megatron_patches.py::_gather_summing_rope_key``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.models.test_moe_ep_step import GRADIENT_RTOL, WEIGHT_RTOL, worst_relative
from tests.distributed.models.workers.moe_ep_step_worker import OPTIM
from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "moe_ep_step_worker.py"
REFERENCE = "ep1/plain"
RUNS = ["tp2/plain", "ep2xtp2/plain"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("sigmoid_moe_step") / "runs.pt"
    run_workers(WORKER, 2, str(out), "deepseek_v3", timeout=400)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("run", RUNS)
def test_gradients_equal_tp1s(runs, run):
    want, got = runs[REFERENCE]["grads"], runs[run]["grads"]
    rope_key = [n for n in want if n.endswith("kv_a_proj_with_mqa.weight")]
    assert len(rope_key) == 3 and all(want[n].abs().max() > 0 for n in rope_key)
    worst, name = worst_relative(want, got)
    assert worst <= GRADIENT_RTOL, f"{run}: {name} differs by {worst:.2e} of its largest entry"


@pytest.mark.parametrize("run", RUNS)
def test_updated_weights_equal_tp1s(runs, run):
    worst, name = worst_relative(runs[REFERENCE]["weights"], runs[run]["weights"])
    assert worst <= WEIGHT_RTOL, f"{run}: {name} differs by {worst:.2e} of its largest weight"
    got, want = runs[run]["metrics"], runs[REFERENCE]["metrics"]
    assert abs(got["grad_norm"] / want["grad_norm"] - 1) <= GRADIENT_RTOL


def test_the_step_moved_every_parameter(runs):
    initial, updated = runs["initial"], runs[REFERENCE]["weights"]
    bias = [n for n in initial if n.endswith("e_score_correction_bias")]
    assert bias and all(torch.equal(initial[n], updated[n]) for n in bias)  # frozen: rate 0
    moved = min((updated[n] - initial[n]).abs().max().item() for n in initial if n not in bias)
    assert moved > OPTIM.lr / 10, moved
