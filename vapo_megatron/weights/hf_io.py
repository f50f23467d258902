"""Stream a Hugging Face checkpoint directory: ``config.json`` plus safetensors, tensor by tensor.

``HFCheckpoint(dir)`` reads the names, shapes and dtypes of every tensor from the safetensors
headers alone (a single ``model.safetensors``, or the files an index
``model.safetensors.index.json`` names) and yields tensors lazily, one at a time, each read with
plain file reads into its own memory, so a converter holds only the tensors it keeps. ``SafetensorsWriter`` is the way back: it
buffers tensors up to ``max_shard_bytes``, writes each full buffer as one shard and, when there is
more than one, the index that ``transformers.from_pretrained`` reads. A single shard is written
as ``model.safetensors`` without an index, as ``save_pretrained`` does.

Errors a user can cause (a missing config, a file the index names but the directory lacks, a
tensor in two files) raise ``ValueError`` saying what is wrong with which file.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from vapo_megatron.models.config import CONFIG_NAME

if TYPE_CHECKING:
    from vapo_megatron.config.train import TrainConfig
    from vapo_megatron.models.config import HFModelConfig

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""Shard size of exported checkpoints (the size of published Qwen2.5 shards); it bounds the
exporter's buffer, hence its memory."""

# safetensors dtype names (header) <-> torch dtypes.
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# Files of an HF model directory that are not weights or the model config: tokenizer, generation
# config, chat template... An exported checkpoint carries them over.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor is and what it is, from its file's header."""

    file: str
    """File name within the checkpoint directory."""
    shape: tuple[int, ...]
    """Shape."""
    dtype: torch.dtype
    """Element type."""
    offset: int
    """Byte offset of its data from the start of the file."""

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _element_size(self.dtype)


class HFCheckpoint:
    """A Hugging Face checkpoint directory, read lazily."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.config: dict[str, Any] = read_config(self.path)
        """The parsed ``config.json``."""
        self.tensors: dict[str, TensorInfo] = _read_headers(self.path)
        """Every tensor by name, in file order."""

    @property
    def names(self) -> list[str]:
        """Every tensor name, in file order."""
        return list(self.tensors)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in all files."""
        return sum(info.nbytes for info in self.tensors.values())

    def read(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` for ``names``, one tensor in memory at a time.

        Tensors come in file order (each file read front to back), not in the order of
        ``names``; each owns its memory. ValueError for a name the checkpoint lacks.
        """
        wanted = set(names)
        unknown = sorted(wanted - self.tensors.keys())
        if unknown:
            raise ValueError(f"{self.path}: no tensor(s) {unknown[:8]} in the checkpoint")
        by_file: dict[str, list[str]] = {}
        for name, info in self.tensors.items():
            if name in wanted:
                by_file.setdefault(info.file, []).append(name)
        for file, file_names in by_file.items():
            with open(self.path / file, "rb", buffering=0) as f:
                for name in file_names:
                    yield name, _read_tensor(f, self.tensors[name])


class SafetensorsWriter:
    """Write tensors into size-capped safetensors shards plus an index, as HF names them.

    ``add`` tensors in any order, then ``close()``. Shards hold whole tensors, in arrival order;
    a tensor larger than ``max_shard_bytes`` gets a shard of its own. Peak memory is one shard's
    worth of tensors: safetensors writes from the tensors' memory without another copy.
    """

    def __init__(
        self, out_dir: str | os.PathLike, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    ) -> None:
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list[list[str]] = []  # tensor names of each written shard
        self._names: set[str] = set()
        self._total_bytes = 0
        self._closed = False

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor; writes a shard when the buffer would pass ``max_shard_bytes``."""
        if self._closed:
            raise ValueError("SafetensorsWriter is closed")
        if name in self._names:
            raise ValueError(f"tensor {name!r} added twice")
        self._names.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        # A view would keep its base alive and safetensors refuses shared storage.
        whole = tensor.untyped_storage().nbytes() == nbytes
        self._buffer[name] = (
            tensor
            if whole and tensor.is_contiguous()
            else tensor.clone(memory_format=torch.contiguous_format)
        )
        self._buffer_bytes += nbytes

    def close(self) -> list[Path]:
        """Write what is left, name the shards and write the index; return the weight files."""
        if self._closed:
            raise ValueError("SafetensorsWriter is closed")
        if self._buffer or not self._shards:
            self._flush()
        self._closed = True
        count = len(self._shards)
        if count == 1:
            os.replace(self._tmp_name(0), self.out_dir / WEIGHTS_NAME)
            return [self.out_dir / WEIGHTS_NAME]
        files, weight_map = [], {}
        for i, names in enumerate(self._shards):
            file = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self._tmp_name(i), self.out_dir / file)
            files.append(self.out_dir / file)
            weight_map.update(dict.fromkeys(names, file))
        index = {"metadata": {"total_size": self._total_bytes}, "weight_map": weight_map}
        (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return files

    def _tmp_name(self, i: int) -> Path:
        # The shard count is known only at the end; shards are renamed then.
        return self.out_dir / f".model-{i + 1:05d}.safetensors.partial"

    def _flush(self) -> None:
        save_file(self._buffer, self._tmp_name(len(self._shards)), metadata={"format": "pt"})
        self._shards.append(list(self._buffer))
        self._total_bytes += self._buffer_bytes
        self._buffer, self._buffer_bytes = {}, 0


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``config.json`` of an HF model directory."""
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise ValueError(f"{path} has no {CONFIG_NAME}: not a Hugging Face model directory")
    return json.loads(file.read_text())


def written_model_configs(config: TrainConfig) -> dict[str, tuple[str, HFModelConfig]]:
    """ "policy" and "critic" -> (HF directory, its config), for the recipe's models already
    on disk (a tiny model is written on first use, a critic.model preset when it is built):
    what ``config.checks.check_layouts_on_models`` checks each layout against before any model
    is built."""
    from vapo_megatron.models.config import HFModelConfig

    paths = {"policy": config.model.path, "critic": config.critic.model or config.model.path}
    return {
        role: (path, HFModelConfig.from_hf(read_config(path)))
        for role, path in paths.items()
        if (Path(path) / CONFIG_NAME).is_file()
    }


def write_config(path: str | os.PathLike, config: dict[str, Any]) -> None:
    """Write ``config.json`` as transformers does (sorted keys, 2-space indent)."""
    (Path(path) / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def asset_files(path: str | os.PathLike) -> list[Path]:
    """Top-level files of an HF model directory other than weights, indexes and config.json
    (tokenizer, generation config, chat template...)."""
    return sorted(
        p
        for p in Path(path).iterdir()
        if p.is_file()
        and p.name != CONFIG_NAME
        and not p.name.endswith(_WEIGHT_SUFFIXES)
        and not p.name.endswith(".index.json")
        and not p.name.startswith(".")
    )


def copy_assets(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy ``asset_files(src)`` into ``dst``; return their names."""
    names = []
    for file in asset_files(src):
        shutil.copyfile(file, Path(dst) / file.name)
        names.append(file.name)
    return names


def _read_headers(path: Path) -> dict[str, TensorInfo]:
    index = path / INDEX_NAME
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = list(dict.fromkeys(weight_map.values()))
        missing = [file for file in files if not (path / file).is_file()]
        if missing:
            raise ValueError(f"{index} names file(s) that {path} lacks: {missing}")
    elif (path / WEIGHTS_NAME).is_file():
        weight_map, files = {}, [WEIGHTS_NAME]
    else:
        raise ValueError(f"{path} has neither {WEIGHTS_NAME} nor {INDEX_NAME}")
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        for name, info in _read_header(path / file, file).items():
            if name in tensors:
                raise ValueError(f"tensor {name!r} is in both {tensors[name].file} and {file}")
            if weight_map and weight_map.get(name) != file:
                raise ValueError(
                    f"{file} holds {name!r}, but {INDEX_NAME} maps it to {weight_map.get(name)}"
                )
            tensors[name] = info
    absent = sorted(weight_map.keys() - tensors.keys())
    if absent:
        raise ValueError(f"{INDEX_NAME} lists tensor(s) no file holds: {absent[:8]}")
    return tensors


def _read_header(file: Path, name: str) -> dict[str, TensorInfo]:
    """Tensor infos of one safetensors file, in data order: 8-byte length, JSON, data."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    data_start = 8 + length
    header.pop("__metadata__", None)
    infos = {}
    for tensor_name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        if entry["dtype"] not in _DTYPES:
            raise ValueError(
                f"{file}: tensor {tensor_name!r} has unsupported dtype {entry['dtype']}"
            )
        infos[tensor_name] = TensorInfo(
            file=name,
            shape=tuple(entry["shape"]),
            dtype=_DTYPES[entry["dtype"]],
            offset=data_start + entry["data_offsets"][0],
        )
    return infos


def _read_tensor(f: io.RawIOBase, info: TensorInfo) -> torch.Tensor:
    """One tensor read into fresh memory with plain reads: unlike safetensors' memory map,
    the file's pages do not join this process's resident memory."""
    tensor = torch.empty(info.shape, dtype=info.dtype, device="cpu")  # read from a file: host
    buffer = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    f.seek(info.offset)
    done = 0
    while done < len(buffer):
        count = f.readinto(buffer[done:])
        if not count:
            raise ValueError(f"{f.name}: file ends inside a tensor (truncated?)")
        done += count
    return tensor


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
