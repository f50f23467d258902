"""Worker of part ``vllm_routes`` (one of 2 ranks): one vLLM engine replica at TP 2 over both
ranks, recording routed experts, generating from a tiny Qwen3-MoE.

Usage: ``python -m gpu_checks.vllm_routes_worker WORKDIR DTYPE`` as 2 ranks
(``spawn.run_ranks``). Built through the project's engine wrapper as the trainer starts it
(``trainer/session.py::start_rollout``): ``init_distributed`` (NCCL, GPU LOCAL_RANK), then
``RolloutEngine(RolloutConfig(tensor_parallel_size=2, record_routes=True))`` in the job, which
makes both ranks one replica under vLLM's ``external_launcher`` (``rollout/vllm_args.py``) and
asks vLLM for ``enable_return_routed_experts``. vLLM 0.32 (read in its sources) returns
``CompletionOutput.routed_experts`` [prompt + response - 1, layers, top_k] only with Model
Runner V2, and its aux-output worker hands the data to the first TP rank only while each rank's
scheduler still takes an output: the TP > 1 case this part exists for. The wrapper's contract
(``RolloutSample.routes``) is what is recorded: every rank writes its samples' tokens and its
routes' shape, range and a checksum; the part compares the ranks.

The model is the moe part's tiny Qwen3-MoE (8 experts, top 2, 2 layers) made wider where vLLM's
CUDA kernels want it (head_dim 64, hidden 128, expert width 64: 32 per TP rank), written with
seeded random weights by rank 0.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gpu_checks.moe_part import moe_hf_tensors
from gpu_checks.spawn import write_result
from gpu_checks.tiny import write_hf_dir
from gpu_checks.vllm_routes_part import NEW_TOKENS, PROMPTS, SAMPLES, VLLM_MOE_CONFIG
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.rollout.engine import RolloutConfig, RolloutEngine
from vapo_megatron.trainer.session import init_distributed


def routes_summary(routes: torch.Tensor | None) -> dict | None:
    """Shape, range and an order-sensitive checksum of one sample's routes (None: none)."""
    if routes is None:
        return None
    flat = routes.to(torch.int64).flatten()
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.int64, device=flat.device)
    return {
        "shape": list(routes.shape), "dtype": str(routes.dtype).removeprefix("torch."),
        "min": int(flat.min()) if flat.numel() else None,
        "max": int(flat.max()) if flat.numel() else None,
        "checksum": int((flat * weights).sum()),
    }  # fmt: skip


def main(workdir: str, dtype_name: str) -> None:
    init_distributed()
    rank = dist.get_rank()
    model = Path(workdir) / "model"
    if rank == 0:
        dtype = getattr(torch, dtype_name)
        tensors = moe_hf_tensors(HFModelConfig.from_hf(VLLM_MOE_CONFIG), dtype)
        write_hf_dir(model, tensors, dtype, config=VLLM_MOE_CONFIG)
    dist.barrier()
    start = time.perf_counter()
    engine = RolloutEngine(
        RolloutConfig(
            model_path=str(model), tensor_parallel_size=2, dtype=dtype_name, max_model_len=256,
            seed=0, kv_cache_bytes=256 << 20, gpu_memory_utilization=0.3, record_routes=True,
        )
    )  # fmt: skip
    started = time.perf_counter() - start
    samples = engine.generate(
        PROMPTS, n=SAMPLES, temperature=1.0, max_new_tokens=NEW_TOKENS, seed=7
    )  # fmt: skip
    result = {
        "rank": rank, "replica": engine.replica, "replica_rank": engine.replica_rank,
        "route_shape": list(engine.route_shape or ()), "start_seconds": started,
        "samples": [
            {
                "prompt": s.prompt_index, "sample": s.sample_index,
                "tokens": s.response_token_ids.tolist(), "routes": routes_summary(s.routes),
            }
            for s in samples
        ],
    }  # fmt: skip
    write_result(workdir, rank, result)
    engine.shutdown()  # vLLM's teardown destroys the default group too


if __name__ == "__main__":
    main(*sys.argv[1:])
