"""The CPU shim makes megatron-core train, pipeline, shard and checkpoint on gloo correctly.

One 2-process launch (``workers/shim_worker.py``) runs every layout; the tests below read what
each rank measured. Reference: the TP=1/PP=1 model from the same seed on the same batches.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.launcher import run_workers
from vapo_megatron.parallel.cpu_shim import apply_cpu_shim

WORKER = Path(__file__).parent / "workers" / "shim_worker.py"
FP32_TOL = 1e-5
BF16_ULP = 2.0**-7  # relative spacing of bfloat16 numbers (upper bound)
# Grad norms of the distributed and the plain optimizer (two steps at DP=2), relative.
# fp32: both hold the same fp32 grads (a DP sum of two terms does not depend on the order);
# only the order in which the norm adds the ~1.4e5 squares differs (per tensor vs per shard,
# then over ranks). Blocked summation of n positive terms errs by <= log2(n) * 2^-24 ~ 1.0e-6
# relative, halved by the square root: 5e-7 (kernel-order differences in the fp32 grads
# themselves are a few 2^-24), so 1e-6 holds with a factor of 2.
FP32_NORM_REL = 1e-6
# bf16: the grads come from bf16-rounded activations. The optimizers lay the parameters out
# differently (one padded buffer of views vs separate tensors), and on CPUs with AMX or
# AVX512-BF16 oneDNN picks its GEMM blocking, hence the fp32 accumulation order, by shape and
# alignment: an output near a rounding boundary lands on the neighbouring bf16 value, one
# spacing (<= 2^-7 relative) away; in step 2 the bf16 weights may already differ by one spacing
# (checked below). To first order each grad element then differs by at most one spacing, and
# the norm, 1-Lipschitz (| |a| - |b| | <= |a - b|), by at most that relative amount: 2^-7. A
# real fault (a lost shard, a missing or doubled DP reduction) moves it by tens of percent.
BF16_NORM_REL = BF16_ULP


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Each rank's measurements from one launch of the worker."""
    out_dir = tmp_path_factory.mktemp("shim")
    run_workers(WORKER, 2, str(out_dir), timeout=150)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.unit
def test_apply_cpu_shim_is_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.pipeline_parallel import schedules

    assert apply_cpu_shim() is True
    patched = (
        schedules.torch,
        clip_grads.clip_grad_by_total_norm_fp32,
        distrib_optimizer.DistributedOptimizer.__init__,
        torch.cuda.current_device,
    )
    assert apply_cpu_shim() is True
    assert patched == (
        schedules.torch,
        clip_grads.clip_grad_by_total_norm_fp32,
        distrib_optimizer.DistributedOptimizer.__init__,
        torch.cuda.current_device,
    )
    assert torch.cuda.current_device() == torch.device("cpu")
    assert schedules.torch.zeros(2, device="cuda").device.type == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert apply_cpu_shim() is False


@pytest.mark.distributed
def test_initialize_returns_groups_of_each_layout(ranks: list[dict]) -> None:
    # [tp, pp, cp, dp, dp_cp] sizes at world size 2.
    for rank in ranks:
        assert rank["groups_dp2"] == [1, 1, 1, 2, 2]
        assert rank["groups_tp2"] == [2, 1, 1, 1, 1]
        assert rank["groups_pp2"] == rank["groups_vpp2"] == [1, 2, 1, 1, 1]


@pytest.mark.distributed
def test_tp2_matches_tp1(ranks: list[dict]) -> None:
    for rank in ranks:
        # Same seed, use_cpu_initialization: bit-identical weights only if RNG state sets stick.
        assert rank["tp2_init_max_diff"] == 0.0
        assert rank["tp2_loss"] == pytest.approx(rank["ref_loss"], abs=FP32_TOL)
        assert rank["tp2_grad_max_diff"] < FP32_TOL


@pytest.mark.distributed
def test_rng_tracker_fork_isolates_and_does_not_leak(ranks: list[dict]) -> None:
    for rank in ranks:
        assert rank["rng"] == {
            "fork_leaves_default_stream": True,
            "fork_uses_own_stream": True,
            "fork_state_advances": True,
            "reseed_restarts_fork": True,
            "tp_ranks_fork_differently": True,
            "queued_cuda_calls_added": 0,
            "fork_warnings": 0,
        }


@pytest.mark.distributed
def test_tp2_optimizer_step_with_clipping(ranks: list[dict]) -> None:
    for rank in ranks:
        assert math.isfinite(rank["tp2_loss"])
        assert rank["tp2_grad_norm"] > 1e-3  # so clip_grad=1e-3 scaled the grads
        assert rank["tp2_step_min_change"] > 1e-3  # every parameter moved
        assert rank["tp2_loss_after_step"] < rank["tp2_loss"]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["pp2", "vpp2"])
def test_pipeline_matches_no_pipeline(ranks: list[dict], layout: str) -> None:
    first, last = ranks
    assert first[f"{layout}_loss"] is None  # losses come back on the last stage only
    assert last[f"{layout}_loss"] == pytest.approx(last["ref_loss"], abs=FP32_TOL)
    for rank in ranks:
        assert rank[f"{layout}_grad_max_diff"] < FP32_TOL


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_distributed_optimizer_matches_plain(ranks: list[dict], dtype: str) -> None:
    for rank in ranks:
        check = rank[f"distopt_{dtype}"]
        norm_rel = FP32_NORM_REL if dtype == "fp32" else BF16_NORM_REL
        assert check["grad_norms"] == pytest.approx(check["plain_grad_norms"], rel=norm_rel)
        if dtype == "fp32":
            assert check["max_rel_diff"] <= FP32_TOL
            continue
        # bf16 weights, as one vector: each is rounded (one spacing, 2^-7 |w|), and the updates,
        # linear in the grads (Adam with eps >> sqrt(v), see the worker), differ by at most what
        # the grads do, 2^-7 |update| (as for the norm above), with |update| < |w|: 2 * 2^-7.
        # Elementwise a grad at rounding level can change sign, so no per-element bound holds.
        assert check["norm_rel_diff"] <= 2 * BF16_ULP
        assert check["update_rel_size"] > 4 * BF16_ULP  # the steps moved the weights: can fail


@pytest.mark.distributed
def test_dist_checkpoint_round_trip(ranks: list[dict]) -> None:
    for rank in ranks:
        assert rank["ckpt"]["diff_before_load"] > 0.0
        assert rank["ckpt"]["diff_after_load"] == 0.0


@pytest.mark.distributed
def test_rope_context_parallel_slice(ranks: list[dict]) -> None:
    for rank in ranks:
        assert rank["rope_cp_max_diff"] == 0.0
