"""Worker: HF -> Megatron conversions and loads at other layouts, on gloo; or exports.

Usage: ``python convert_worker.py PLAN.json`` as N ranks (``tests/launcher.py``). The plan:

- ``conversions``: ``hf_to_mcore`` runs, each at its own TP x PP (the remaining ranks are
  data-parallel replicas, which megatron does not let write twice);
- ``loads``: load a checkpoint into freshly built chunks (optionally in a ``Float16Module``) at
  another TP x PP (resharding) and compare every parameter with the shard the model record
  makes from the HF tensors, or record the ValueError;
- ``exports``: ``mcore_to_hf`` runs (one rank).

Each rank writes what it measured to ``{plan.out}/rank{r}.json``; the test asserts on it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import unwrap_model

from vapo_megatron.checkpoint import model as ckpt
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.models.provider import build_model, transformer_config
from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu
from vapo_megatron.weights import convert as conv
from vapo_megatron.weights.hf_io import HFCheckpoint
from vapo_megatron.weights.record import ModelChunk

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}


def convert(job: dict) -> None:
    initialize_megatron_cpu(tp=job["tp"], pp=job["pp"], ep=job.get("ep", 1), etp=job.get("etp"))
    source = conv.inspect_hf(
        job["hf"], critic_from=job.get("critic_from"), dtype=DTYPES[job.get("dtype")]
    )
    conv.hf_to_mcore(source, job["out"])


def load(job: dict) -> dict:
    """Load ``job['ckpt']`` at ``job['tp']`` x ``job['pp']``; compare with the HF tensors."""
    from megatron.core import parallel_state as ps

    initialize_megatron_cpu(tp=job["tp"], pp=job["pp"])
    meta = ckpt.load_metadata(job["ckpt"])
    hf_dir = HFCheckpoint(job["hf"])
    hf = meta.model_config()
    head = job.get("head", meta.head)
    params_dtype = DTYPES[job.get("params_dtype")] or meta.torch_dtype
    config = transformer_config(
        hf, ModelLayout(tp=job["tp"], pp=job["pp"]), params_dtype=params_dtype
    )
    chunks = build_model(hf, config, head=head)
    if job.get("float16_module"):  # as the trainer wraps bf16 models: keys must not change
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    try:
        ckpt.load_model_weights(chunks, job["ckpt"], hf=hf, head=head)
    except ValueError as error:
        return {"error": str(error)}
    source = conv.inspect_hf(
        job["hf"], critic_from=meta.origin.get("critic_from"), dtype=meta.torch_dtype
    )
    record = source.record()
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), job["tp"]
    chunk = ModelChunk.for_stage(config, ps.get_pipeline_model_parallel_rank())
    expected = record.hf_to_megatron_shards(
        conv._hf_stream(source, record, chunk), tp_rank, tp, chunk
    )
    params = dict(unwrap_model(chunks[0]).named_parameters())
    assert params.keys() == expected.keys(), sorted(params.keys() ^ expected.keys())
    unequal = [
        name
        for name, want in expected.items()
        if not torch.equal(params[name].detach(), want.to(meta.torch_dtype).to(params[name].dtype))
    ]
    del hf_dir
    return {"compared": len(expected), "unequal": unequal}


def main(plan_file: str) -> None:
    plan = json.loads(Path(plan_file).read_text())
    for job in plan.get("conversions", []):
        convert(job)
    results = {"loads": [load(job) for job in plan.get("loads", [])]}
    for job in plan.get("exports", []):
        conv.mcore_to_hf(
            job["ckpt"], job["out"], max_shard_bytes=job.get("max_shard_bytes", 5 * 10**9)
        )
    rank = int(os.environ.get("RANK", "0"))
    Path(plan["out"], f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    destroy() if dist.is_initialized() else None


if __name__ == "__main__":  # dist_checkpointing's writer spawns processes that import this file
    main(sys.argv[1])
