"""Write a trained model as a Hugging Face directory (the policy at the end of a run, the
critic after pretraining). The weights come through the same stream as the rollout sync (TP
gather, PP broadcast, in buckets: ``ModelEngine.hf_buckets``), so any layout exports; rank 0
writes the files."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from vapo_megatron.checkpoint.model import make_metadata
from vapo_megatron.models.config import Head, HFModelConfig
from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.weights import hf_io
from vapo_megatron.weights.buckets import NamedTensor
from vapo_megatron.weights.mtp import MTP_COPIES, mtp_copies, mtp_tensors

BUCKET_BYTES = 256 << 20
"""Bucket size of the export's stream (``ModelEngine.hf_buckets(BUCKET_BYTES)``)."""


def export_hf(
    buckets: Iterable[list[NamedTensor]],
    out_dir: Path,
    *,
    hf_config: dict,
    head: Head,
    dtype: torch.dtype,
    assets_from: str,
    host_group: dist.ProcessGroup | None,
    mtp_in_stream: bool = False,
) -> Path:
    """Collective: every rank consumes its ``buckets`` (the model's stream, e.g.
    ``ModelEngine.hf_buckets(BUCKET_BYTES)``); rank 0 writes ``out_dir`` (replaced atomically)
    while the others wait on ``host_group`` (gloo: the wait costs no GPU and follows its
    timeout). ``head``, ``dtype``: the model's, for the written config. A policy with MTP
    layers (DeepSeek-V3) gets them from ``assets_from``'s HF checkpoint, unchanged
    (``weights/mtp.py``), or, ``mtp_in_stream`` (trained in the model: ``models/mtp.py``), from
    the stream, with each MTP layer's copies of the trained lm head and embedding
    (``shared_head.head``, ``embed_tokens``) as DeepSeek-V3's checkpoints hold them."""
    rank = dist.get_rank()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    writer = None
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        writer = hf_io.SafetensorsWriter(tmp)
    shared: dict[str, torch.Tensor] = {}  # what the MTP layers' copies copy
    for bucket in buckets:
        if writer is not None:
            for name, tensor in bucket:
                host = tensor.to(HOST, copy=True)  # safetensors writes host memory
                writer.add(name, host)
                if mtp_in_stream and name in MTP_COPIES:
                    shared[name] = host
    if rank == 0:
        hf = HFModelConfig.from_hf(hf_config) if head == "lm" else None
        for name, tensor in mtp_copies(hf, shared):  # trained in the model
            writer.add(name, tensor)
        if hf is not None and hf.mtp_num_layers and not mtp_in_stream:  # frozen, as it started
            for name, tensor in mtp_tensors(assets_from, hf):
                writer.add(name, tensor)
        writer.close()
        meta = make_metadata(hf_config, head=head, tp=1, pp=1, dtype=dtype)
        hf_io.write_config(tmp, meta.hf_config)
        hf_io.copy_assets(assets_from, tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    collectives.barrier(host_group)
    return out_dir
