"""Write a trained model as a Hugging Face directory (the policy at the end of a run, the
critic after pretraining). The weights come through the same stream as the rollout sync (TP
gather, PP broadcast, in buckets), so any layout exports; rank 0 writes the files."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from vapo_megatron.checkpoint.model import make_metadata
from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.weights import hf_io
from vapo_megatron.weights.stream import stream_policy_weights

if TYPE_CHECKING:
    from vapo_megatron.trainer.model_engine import ModelEngine

BUCKET_BYTES = 256 << 20


def export_hf(
    engine: ModelEngine,
    out_dir: Path,
    *,
    hf_config: dict,
    assets_from: str,
    host_group: dist.ProcessGroup | None,
) -> Path:
    """Collective: every rank streams; rank 0 writes ``out_dir`` (replaced atomically) while
    the others wait on ``host_group`` (gloo: the wait costs no GPU and follows its timeout)."""
    rank = dist.get_rank()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    writer = None
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        writer = hf_io.SafetensorsWriter(tmp)
    engine.gather_params()  # the last update's shards, with overlap_param_gather
    buckets = stream_policy_weights(
        engine.chunks, engine.record, engine.config,
        tp_group=engine.groups.parallel.tp, pp_group=engine.groups.parallel.pp,
        ep_group=engine.groups.pg_collection.ep, expt_tp_group=engine.groups.pg_collection.expt_tp,
        bucket_bytes=BUCKET_BYTES,
    )  # fmt: skip
    for bucket in buckets:
        if writer is not None:
            for name, tensor in bucket:
                writer.add(name, tensor.to(HOST, copy=True))  # safetensors writes host memory
    if rank == 0:
        writer.close()
        meta = make_metadata(
            hf_config, head=engine.head, tp=1, pp=1, dtype=engine.config.params_dtype
        )
        hf_io.write_config(tmp, meta.hf_config)
        hf_io.copy_assets(assets_from, tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    collectives.barrier(host_group)
    return out_dir
