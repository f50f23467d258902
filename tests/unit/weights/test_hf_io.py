"""Streaming HF checkpoint I/O: sharded writing with an index, lazy reading, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vapo_megatron.weights import hf_io

pytestmark = pytest.mark.unit


def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(50, 8, generator=gen),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=gen),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(8, generator=gen).bfloat16(),
        "model.norm.weight": torch.randn(8, generator=gen),
        "lm_head.weight": torch.randn(50, 8, generator=gen),
    }


def write(out: Path, named: dict[str, torch.Tensor], max_shard_bytes: int) -> list[Path]:
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text("{}")
    writer = hf_io.SafetensorsWriter(out, max_shard_bytes)
    for name, tensor in named.items():
        writer.add(name, tensor)
    return writer.close()


def test_single_shard_is_model_safetensors_without_index(tmp_path: Path) -> None:
    files = write(tmp_path, tensors(), max_shard_bytes=10**9)
    assert [f.name for f in files] == ["model.safetensors"]
    assert not (tmp_path / hf_io.INDEX_NAME).exists()
    assert not list(tmp_path.glob(".*partial"))
    loaded = load_file(tmp_path / "model.safetensors")
    for name, tensor in tensors().items():
        assert torch.equal(loaded[name], tensor) and loaded[name].dtype == tensor.dtype


def test_sharding_by_size_writes_hf_names_and_index(tmp_path: Path) -> None:
    named = tensors()
    # 50 x 8 fp32 = 1600 bytes: the embedding fills a shard; lm_head is larger than the cap.
    files = write(tmp_path, named, max_shard_bytes=1700)
    count = len(files)
    assert count == 3
    assert [f.name for f in files] == [
        f"model-0000{i}-of-0000{count}.safetensors" for i in (1, 2, 3)
    ]
    index = json.loads((tmp_path / hf_io.INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in named.values()
    )
    assert set(index["weight_map"]) == set(named)
    assert index["weight_map"]["model.embed_tokens.weight"] == files[0].name
    assert index["weight_map"]["lm_head.weight"] == files[2].name
    for file in files:
        assert file.stat().st_size < 1700 + 1000  # header + data; each shard at most one cap
    checkpoint = hf_io.HFCheckpoint(tmp_path)
    assert set(checkpoint.names) == set(named)
    assert checkpoint.nbytes == index["metadata"]["total_size"]
    for name, tensor in checkpoint.read(named):
        assert torch.equal(tensor, named[name]) and tensor.dtype == named[name].dtype


def test_views_and_non_contiguous_tensors_are_written_as_values(tmp_path: Path) -> None:
    base = torch.arange(64.0).reshape(8, 8)
    named = {"a": base[:2], "b": base.t(), "c": base[2:4]}
    write(tmp_path, named, max_shard_bytes=10**9)
    loaded = load_file(tmp_path / "model.safetensors")
    for name, tensor in named.items():
        assert torch.equal(loaded[name], tensor)


def test_reader_reports_headers_and_reads_only_what_is_asked(tmp_path: Path) -> None:
    named = tensors()
    write(tmp_path, named, max_shard_bytes=1700)
    checkpoint = hf_io.HFCheckpoint(tmp_path)
    info = checkpoint.tensors["model.layers.0.self_attn.q_proj.bias"]
    assert info.shape == (8,) and info.dtype == torch.bfloat16 and info.nbytes == 16
    got = dict(checkpoint.read(["model.norm.weight", "lm_head.weight"]))
    assert set(got) == {"model.norm.weight", "lm_head.weight"}
    with pytest.raises(ValueError, match="no tensor"):
        list(checkpoint.read(["model.layers.9.mlp.up_proj.weight"]))


def test_writer_rejects_duplicates_and_use_after_close(tmp_path: Path) -> None:
    writer = hf_io.SafetensorsWriter(tmp_path, 100)
    writer.add("a", torch.zeros(40))  # 160 bytes: flushed when the next tensor arrives
    writer.add("b", torch.zeros(1))
    with pytest.raises(ValueError, match="added twice"):
        writer.add("a", torch.zeros(1))
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        writer.add("c", torch.zeros(1))


@pytest.mark.parametrize(
    "damage, message",
    [
        ("no_config", "no config.json"),
        ("no_weights", "neither model.safetensors nor"),
        ("index_names_missing_file", "names file"),
        ("index_lists_absent_tensor", "no file holds"),
        ("tensor_in_two_files", "in both"),
    ],
)
def test_reader_errors(tmp_path: Path, damage: str, message: str) -> None:
    write(tmp_path, tensors(), max_shard_bytes=1700)
    index_file = tmp_path / hf_io.INDEX_NAME
    index = json.loads(index_file.read_text())
    if damage == "no_config":
        (tmp_path / "config.json").unlink()
    elif damage == "no_weights":
        for file in tmp_path.glob("*.safetensors*"):
            file.unlink()
    elif damage == "index_names_missing_file":
        next(tmp_path.glob("model-00002-*")).unlink()
    elif damage == "index_lists_absent_tensor":
        index["weight_map"]["extra.weight"] = next(iter(index["weight_map"].values()))
        index_file.write_text(json.dumps(index))
    else:
        first = tmp_path / index["weight_map"]["model.embed_tokens.weight"]
        save_file(
            {"model.embed_tokens.weight": torch.zeros(1), "lm_head.weight": torch.zeros(1)}, first
        )
    with pytest.raises(ValueError, match=message):
        hf_io.HFCheckpoint(tmp_path)


def test_assets_are_non_weight_files(tmp_path: Path) -> None:
    write(tmp_path, tensors(), max_shard_bytes=1700)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "pytorch_model.bin",
    ):
        (tmp_path / name).write_text("{}")
    dst = tmp_path / "out"
    dst.mkdir()
    assert hf_io.copy_assets(tmp_path, dst) == [
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert sorted(p.name for p in dst.iterdir()) == [
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
