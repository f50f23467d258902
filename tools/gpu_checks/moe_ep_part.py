"""Part ``moe_ep``: the tiny Qwen3-MoE at expert parallelism 2 (alltoall dispatcher) on two
ranks, against EP 1 on the same weights, data and routes (``moe_ep_worker.py`` says what each
rank builds and holds).

The check itself is a world of one, so this part launches its own 2 ranks
(``spawn.run_ranks``): on a GPU one per device (NCCL, devices 0 and 1), with ``--cpu`` two gloo
processes (megatron's all-to-all dispatcher runs on gloo; ``parallel/moe_cpu_shim.py``).
Skipped, marked missing devices, on a GPU machine with fewer than 2 visible GPUs.
"""

from __future__ import annotations

from gpu_checks.context import Context
from gpu_checks.frame import Skipped, check
from gpu_checks.spawn import run_ranks

TIMEOUT_S = 240.0
"""The 2-rank launch's limit: two processes importing megatron and building 4 tiny engines
(~20 s on 2 shared CPU cores); past it, a hang (an all-to-all one rank never joins)."""
KEPT = ("max_abs_logit_diff", "max_grad_rel_diff", "grad_norms", "micro_batches", "experts_here")


def skip_reason(ctx: Context) -> None:
    """Skipped on a GPU machine with fewer than 2 GPUs (on --cpu the ranks are processes)."""
    if ctx.device.type == "cuda" and ctx.gpus < 2:
        raise Skipped(f"EP 2 needs 2 GPUs, {ctx.gpus} visible", missing="devices")


def moe_ep(ctx: Context, numbers: dict) -> None:
    skip_reason(ctx)
    ctx.results.need("distributed")
    dtype = str(ctx.dtype).removeprefix("torch.")
    ranks = run_ranks("moe_ep_worker", 2, ctx.workdir / "moe_ep", dtype, timeout=TIMEOUT_S)
    first = ranks[0]
    numbers.update(
        ranks_returned=len(ranks), backend=first["backend"], spec=first["spec"],
        modules=first["modules"], route_agreement=[r["route_agreement"] for r in ranks],
        **{key: [r[key] for r in ranks] for key in KEPT},
    )  # fmt: skip
    experts = [e for r in ranks for e in r["experts_here"]]
    check(sorted(experts, key=int) == [str(e) for e in range(8)], f"experts held {experts}")
    norms = {tuple(r["grad_norms"]) for r in ranks}
    check(len(norms) == 1, f"the ranks disagree on the grad norms: {sorted(norms)}")
