"""EP2 MoE: DP ranks that pack different numbers of micro-batches run in lockstep.

At EP 2 on 2 ranks both DP ranks form the expert-parallel group, and megatron's token
dispatcher runs a collective over it in every MoE layer of every micro-batch: a rank with more
micro-batches than the other waits in it for ever. ``workers/moe_ep_lockstep_worker.py``
(2 gloo ranks, ~20 s) gives rank 0 one micro-batch and rank 1 three, in the scoring pass
(two micro-batches a chunk) and in an update, at EP1 (reference) and EP2, with routing replay.
Before ``batching.line_up`` the EP2 run hung in the dispatcher's all-to-all (the launcher's
timeout: EP1 finished, EP2 never did); now the shorter rank pads with empty micro-batches.

Tolerances as ``test_moe_ep_step.py``'s (same model, optimizer and eps = lr): float32 sums in
another order, measured 9.5e-7 absolute on log-probs of magnitude <= 8, 2.9e-7 relative on
gradients and 8.3e-8 on the updated weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "moe_ep_lockstep_worker.py"
GRADIENT_RTOL = 1e-5
WEIGHT_RTOL = 1e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("moe_ep_lockstep") / "runs.pt"
    run_workers(WORKER, 2, str(out), timeout=120)
    return torch.load(out, weights_only=False)


def worst_relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[n] - b[n]).abs().max() / a[n].abs().max()).item() for n in a)


def test_ep1_packs_unequal_counts_and_makes_no_extra_collective(runs):
    # Per rank: [scoring chunks..., update]. The reference is what EP2 would run unpadded.
    assert runs["ep1"]["counts"] == [[1, 1], [2, 1, 3]]
    assert runs["ep1"]["max_reductions"] == 0


def test_ep2_ranks_run_as_many_micro_batches(runs):
    assert runs["ep2"]["counts"] == [[2, 1, 3], [2, 1, 3]]
    assert runs["ep2"]["max_reductions"] == 2  # one for the scoring pass, one for the update


def test_scored_logprobs_equal_ep1s(runs):
    want, got = runs["ep1"]["logprobs"], runs["ep2"]["logprobs"]
    assert bool((want != 0).all())  # every response token scored
    assert (got - want).abs().max() <= GRADIENT_RTOL * want.abs().max()


def test_update_equals_ep1s(runs):
    want, got = runs["ep1"], runs["ep2"]
    assert worst_relative(want["grads"], got["grads"]) <= GRADIENT_RTOL
    assert worst_relative(want["weights"], got["weights"]) <= WEIGHT_RTOL
    assert want["metrics"].keys() == got["metrics"].keys()
    for key, value in want["metrics"].items():
        assert abs(got["metrics"][key] - value) <= GRADIENT_RTOL * max(abs(value), 1e-3), key
    # Padding adds no tokens and no given routes.
    assert got["metrics"]["num_tokens"] == want["metrics"]["num_tokens"]
    assert got["metrics"]["route_agreement"] == want["metrics"]["route_agreement"]


def test_reference_scorer_lines_up(runs):
    """``outputs.score_flat`` (the checks' reference) at EP2 with unequal shares: it hung in
    the dispatcher before it lined its micro-batches up."""
    want, got = runs["ep1"]["flat"], runs["ep2"]["flat"]
    assert bool((want != 0).all())
    assert (got - want).abs().max() <= GRADIENT_RTOL * want.abs().max()
