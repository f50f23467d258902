"""Checkpoint conversion benchmark: GB/s of tools/convert.py against a plain copy of the bytes.

Writes a synthetic Qwen2 checkpoint of ~1 GB in bf16 (the shapes of Qwen2.5-1.5B, 6 layers,
tied embeddings, 512 MB safetensors shards with an index), then, in this run:

- copies its safetensors files with ``shutil.copyfile`` + ``fsync`` (megatron's checkpoint
  writer fsyncs its files too): the reference;
- runs ``tools/convert.py hf-to-mcore`` (TP=1, PP=1) and ``mcore-to-hf`` (512 MB shards, as
  the source) as a user would, in subprocesses, and reads the time (imports excluded) and
  peak resident memory each reports.

``--quick``: a ~60 MB model, for tests. The numbers depend on the disk and page cache; the
fraction of the copy speed is what carries over between machines.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from vapo_megatron.weights.hf_io import SafetensorsWriter, write_config  # noqa: E402
from vapo_megatron.weights.record import ModelChunk, ModelRecord  # noqa: E402

CONVERT = REPO_ROOT / "tools" / "convert.py"


def synthetic_config(quick: bool) -> dict:
    """Qwen2.5-1.5B's widths with fewer layers (quick: narrower too)."""
    hidden, heads, ffn, vocab, layers = (
        (512, 8, 2816, 32000, 4) if quick else (1536, 12, 8960, 151936, 6)
    )
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "use_sliding_window": False,
    }


def write_synthetic(out: Path, config: dict, shard_bytes: int) -> int:
    """Random bf16 tensors of the config's shapes, streamed into safetensors; returns bytes."""
    from vapo_megatron.models.config import HFModelConfig

    out.mkdir(parents=True)
    write_config(out, config)
    record = ModelRecord(HFModelConfig.from_hf(config))
    writer = SafetensorsWriter(out, shard_bytes)
    gen = torch.Generator().manual_seed(0)
    total = 0
    for name in record.hf_names(ModelChunk.whole(config["num_hidden_layers"])):
        tensor = torch.empty(record.hf_shape(name)).normal_(std=0.02, generator=gen).bfloat16()
        writer.add(name, tensor)
        total += tensor.numel() * tensor.element_size()
    writer.close()
    return total


def copy_files(src: Path, dst: Path) -> float:
    """Seconds to copy src's safetensors files into dst and fsync them."""
    dst.mkdir()
    start = time.perf_counter()
    for file in sorted(src.glob("*.safetensors")):
        shutil.copyfile(file, dst / file.name)
        with open(dst / file.name, "rb+") as f:
            os.fsync(f.fileno())
    return time.perf_counter() - start


def convert(*args: str) -> dict:
    """Run tools/convert.py; its last stdout line (JSON summary)."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    result = subprocess.run(
        [sys.executable, str(CONVERT), *args], capture_output=True, text=True, env=env
    )
    if result.returncode != 0:
        raise RuntimeError(f"convert.py {args[0]} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> None:
    with tempfile.TemporaryDirectory(prefix="bench_convert_") as tmp:
        root = Path(tmp)
        config = synthetic_config(quick)
        shard_mb = 64 if quick else 512
        nbytes = write_synthetic(root / "hf", config, shard_bytes=shard_mb * 2**20)
        gb = nbytes / 1e9
        copy_s = copy_files(root / "hf", root / "copy")
        to_mcore = convert("hf-to-mcore", "--hf", str(root / "hf"), "--out", str(root / "mcore"))
        to_hf = convert(
            "mcore-to-hf",
            *("--ckpt", str(root / "mcore"), "--out", str(root / "back")),
            *("--max-shard-size", f"{shard_mb}MiB"),
        )
        # A second copy after the conversions: the page cache has changed meanwhile.
        shutil.rmtree(root / "copy")
        copy_s = min(copy_s, copy_files(root / "hf", root / "copy"))

    copy_gbps = gb / copy_s
    rows = [
        ("copy + fsync", copy_s, None),
        ("hf-to-mcore", to_mcore["seconds"], to_mcore["peak_rss_gb"]),
        ("mcore-to-hf", to_hf["seconds"], to_hf["peak_rss_gb"]),
    ]
    print(f"synthetic Qwen2 bf16 checkpoint: {gb:.3f} GB, {config['num_hidden_layers']} layers")
    print(f"{'step':<14}{'seconds':>9}{'GB/s':>8}{'x copy':>8}{'s/GB':>7}{'peak RSS GB':>13}")
    for step, seconds, rss in rows:
        rate = gb / seconds
        rss_text = f"{rss:.2f}" if rss is not None else "-"
        print(
            f"{step:<14}{seconds:>9.2f}{rate:>8.2f}{rate / copy_gbps:>8.2f}"
            f"{seconds / gb:>7.2f}{rss_text:>13}"
        )
    gbps = gb / to_mcore["seconds"]
    print(
        json.dumps(
            {
                "bench": "convert",
                "gbps": round(gbps, 3),
                "fraction_of_copy": round(gbps / copy_gbps, 3),
                "copy_gbps": round(copy_gbps, 3),
                "model_gb": round(gb, 3),
                "hf_to_mcore_seconds_per_gb": round(to_mcore["seconds"] / gb, 3),
                "hf_to_mcore_peak_rss_gb": to_mcore["peak_rss_gb"],
                "mcore_to_hf_gbps": round(gb / to_hf["seconds"], 3),
                "mcore_to_hf_fraction_of_copy": round(gb / to_hf["seconds"] / copy_gbps, 3),
                "mcore_to_hf_peak_rss_gb": to_hf["peak_rss_gb"],
            }
        )
    )


if __name__ == "__main__":
    run(quick="--quick" in sys.argv)
