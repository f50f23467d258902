"""DeepSeek-V3's multi-token-prediction layers: carried beside the Megatron model, frozen (the
default), or built in it and trained (``policy.mtp.loss_weight`` > 0, ``models/mtp.py``).

A DeepSeek-V3/Kimi-K2 checkpoint holds ``num_nextn_predict_layers`` (= k) MTP layers after its
decoder, HF ``model.layers.{L}`` .. ``model.layers.{L + k - 1}`` (L = ``num_hidden_layers``):
``enorm``, ``hnorm``, ``eh_proj``, a decoder layer, ``shared_head`` and a copy of the
embedding. RL generation does not use them, but a trained model is served with MTP
speculative decoding, so they must survive, never dropped silently.

Frozen (``loss_weight`` 0): carried as they are, bit for bit: ``tools/convert.py hf-to-mcore``
copies them into the checkpoint's :data:`MTP_DIR` (an HF directory of just these tensors),
``mcore-to-hf`` writes them back, and the trainer's HF export copies them from the model it
started from.

In the model (``loss_weight`` > 0; ``hf-to-mcore --mtp-in-model``): the record names them
(``weights/record.py``), megatron's distributed checkpoint saves and resumes them with the
model, and a checkpoint says so in its metadata's origin (:data:`MTP_ORIGIN`); the export and
``mcore-to-hf`` write the trained layers with each one's copies of the trained lm head and
embedding (:data:`MTP_COPIES`, as DeepSeek-V3's checkpoints hold them). The rollout engine
gets none of them either way (vLLM's deepseek_v2 skips them).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from vapo_megatron.checkpoint.model import CheckpointMetadata
from vapo_megatron.models.config import Head, HFModelConfig
from vapo_megatron.weights import hf_io

MTP_DIR = "mtp"
"""The folder of a Megatron checkpoint (and nothing else) that holds the MTP layers."""
MTP_ORIGIN, MTP_IN_MODEL = "mtp", "model"
"""The checkpoint metadata's origin entry (and its value) of a model that holds its MTP
layers (``hf-to-mcore --mtp-in-model``, or a run that trains them)."""
MTP_COPIES = {
    "lm_head.weight": "shared_head.head.weight",
    "model.embed_tokens.weight": "embed_tokens.weight",
}
"""HF name -> the name of its copy in each MTP layer (``model.layers.{num_layers + k}.``)."""
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


def mtp_copies(
    hf: HFModelConfig, shared: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each MTP layer's copies of the lm head and the embedding (:data:`MTP_COPIES`) from
    ``shared`` (their HF names -> the trained tensors); none when ``shared`` is empty (the MTP
    layers not in the model)."""
    if not shared:
        return
    for layer in range(hf.num_layers, hf.num_layers + hf.mtp_num_layers):
        for source, copy in MTP_COPIES.items():
            yield f"model.layers.{layer}.{copy}", shared[source].clone()


def check_mtp_in_model(hf: HFModelConfig, head: Head, where: str | os.PathLike) -> None:
    """ValueError unless ``hf`` is a policy with MTP layers (what the MTP layers in the model
    need)."""
    if head != "lm":
        raise ValueError(f"{where}: a critic (value head) holds no MTP layers; drop --mtp-in-model")
    if not hf.mtp_num_layers:
        raise ValueError(
            f"{where}: the model has no MTP layers (num_nextn_predict_layers=0); drop "
            "--mtp-in-model (policy.mtp.loss_weight=0)"
        )


def mtp_in_checkpoint(meta: CheckpointMetadata) -> bool:
    """Whether the checkpoint's model holds its MTP layers (else they are files, or none)."""
    return meta.origin.get(MTP_ORIGIN) == MTP_IN_MODEL


def check_policy_checkpoint(meta: CheckpointMetadata, *, trained: bool, path: str) -> None:
    """ValueError when policy.load's checkpoint holds its MTP layers in the model and the run
    carries them as files, or the other way round: one would miss tensors the other has."""
    hf = HFModelConfig.from_hf(meta.hf_config)
    if not hf.mtp_num_layers or mtp_in_checkpoint(meta) == trained:
        return
    if trained:
        raise ValueError(
            f"policy.load={path} carries its MTP layers as files ({MTP_DIR}/), but "
            "policy.mtp.loss_weight > 0 trains them in the model: convert the HF model with "
            "tools/convert.py hf-to-mcore --mtp-in-model, or set policy.mtp.loss_weight=0"
        )
    raise ValueError(
        f"policy.load={path} holds its MTP layers in the model (hf-to-mcore --mtp-in-model), "
        "but policy.mtp.loss_weight=0 carries them as files: set policy.mtp.loss_weight > 0, "
        "or convert without --mtp-in-model"
    )
