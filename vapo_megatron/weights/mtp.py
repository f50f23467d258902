"""DeepSeek-V3's multi-token-prediction layers, carried beside the Megatron model, frozen.

A DeepSeek-V3/Kimi-K2 checkpoint holds ``num_nextn_predict_layers`` (= k) MTP layers after its
decoder, HF ``model.layers.{L}`` .. ``model.layers.{L + k - 1}`` (L = ``num_hidden_layers``):
``enorm``, ``hnorm``, ``eh_proj``, a decoder layer, ``shared_head`` and a copy of the
embedding. RL generation does not use them, but a trained model is served with MTP
speculative decoding, so they must survive. This version does not build them in megatron
(megatron-core 0.16.1's MTP forward needs labels and adds its loss to the main gradient; its
router lies outside the replayed routes: docs/models.md), so they are carried as they are,
bit for bit: ``tools/convert.py hf-to-mcore`` copies them into the checkpoint's
:data:`MTP_DIR` (an HF directory of just these tensors), ``mcore-to-hf`` writes them back, and
the trainer's HF export copies them from the model it started from. Trained MTP layers are
not supported: they stay the checkpoint's.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.weights import hf_io

MTP_DIR = "mtp"
"""The folder of a Megatron checkpoint (and nothing else) that holds the MTP layers."""
_LAYER = re.compile(r"model\.layers\.(\d+)\..+")


def is_mtp_tensor(hf: HFModelConfig, hf_name: str) -> bool:
    """Whether ``hf_name`` belongs to one of ``hf``'s MTP layers."""
    match = _LAYER.fullmatch(hf_name)
    return match is not None and 0 <= int(match[1]) - hf.num_layers < hf.mtp_num_layers


def mtp_tensors(hf_dir: str | os.PathLike, hf: HFModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The MTP tensors of the HF directory ``hf_dir`` as stored (none when the model has no MTP
    layers); ValueError when the model has MTP layers and the directory holds none of one."""
    if not hf.mtp_num_layers:
        return iter(())
    checkpoint = hf_io.HFCheckpoint(hf_dir)
    names = [name for name in checkpoint.names if is_mtp_tensor(hf, name)]
    layers = {int(_LAYER.fullmatch(name)[1]) for name in names}
    missing = sorted(set(range(hf.num_layers, hf.num_layers + hf.mtp_num_layers)) - layers)
    if missing:
        raise ValueError(
            f"{hf_dir}: num_nextn_predict_layers={hf.mtp_num_layers} but no tensors of layers "
            f"{missing}; set num_nextn_predict_layers to the MTP layers the checkpoint has"
        )
    return checkpoint.read(names)


def write_mtp(
    tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | os.PathLike, hf_config: dict
) -> int:
    """Write the MTP tensors into ``out_dir``/:data:`MTP_DIR` (with ``hf_config`` as its
    config.json); returns how many."""
    folder = Path(out_dir) / MTP_DIR
    folder.mkdir(parents=True, exist_ok=True)
    writer = hf_io.SafetensorsWriter(folder)
    count = 0
    for name, tensor in tensors:
        writer.add(name, tensor)
        count += 1
    writer.close()
    hf_io.write_config(folder, hf_config)
    return count
