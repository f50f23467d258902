"""Training-checkpoint benchmark: bytes on disk at DP1 and DP2, seconds a step is blocked.

Policy and critic engines are built on 1 and on 2 gloo ranks (DP1, DP2; TP1), take one
optimizer step on zero gradients (Adam's state exists, the weights stay), and are saved by
``checkpoint/save.py`` several times: synchronously, then in the background. Shapes:
``tiny`` (default) is the tiny recipe's model in fp32, with the distributed optimizer and with
the plain one; ``medium`` is a Qwen2 shape of ~47M parameters in the two models together, in
bf16 with fp32 main params and the distributed optimizer (the 32B recipe's setting). Reported
per setting: the bytes of one checkpoint (all files) and of its tensor files alone, the seconds
``save`` blocks the caller (median over the timed saves; the first background save, which also
starts megatron's result-queue manager, apart), and for background saves the seconds until
published (``finish``).

    python tools/bench_checkpoint.py [--shape tiny|medium]

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORKER_FLAG = "--bench-checkpoint-worker"
SHAPES = {
    # recipes/tiny_cpu.yaml's model (tiny/model.py::tiny_qwen2_config; ~400 tokens).
    "tiny": dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=400, dtype="float32",
    ),
    "medium": dict(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=16000, dtype="bfloat16",
    ),
}  # fmt: skip
TIMED_SAVES = 3


def _worker(shape: str, root: Path, distopt: bool) -> None:
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config

    from vapo_megatron.checkpoint.save import CheckpointSaver
    from vapo_megatron.config.layout import ModelLayout
    from vapo_megatron.models.config import HFModelConfig
    from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu
    from vapo_megatron.parallel.model_groups import build_model_groups

    spec = dict(SHAPES[shape])
    dtype = getattr(torch, spec.pop("dtype"))
    hf_config = Qwen2Config(**spec, max_position_embeddings=512, tie_word_embeddings=False)
    hf = HFModelConfig.from_hf(hf_config.to_dict())
    initialize_megatron_cpu()
    from vapo_megatron.config.optim import OptimSettings
    from vapo_megatron.engine.model_engine import ModelEngine

    groups = build_model_groups(tp=1, pp=1, cp=1)
    optim = OptimSettings(lr=1e-4, distributed_optimizer=distopt)
    states = {}
    for name, head in (("policy", "lm"), ("critic", "value")):
        engine = ModelEngine(
            hf, ModelLayout(), head=head, optim=optim, groups=groups, params_dtype=dtype
        )
        for chunk in engine.chunks:
            chunk.zero_grad_buffer()
        engine.step()  # zero gradients: Adam's state exists, the weights stay
        states[name] = engine.trainable_state()
    out = {"world": dist.get_world_size(), "distopt": distopt}
    for asynchronous in (False, True):
        saver = CheckpointSaver(asynchronous=asynchronous)
        blocked, published = [], []
        for i in range(TIMED_SAVES + 1):
            dist.barrier()
            start = time.perf_counter()
            saver.save(root, i + 1, states, {"step": i + 1}, keep_last=1)
            blocked.append(time.perf_counter() - start)
            saver.finish()
            published.append(time.perf_counter() - start)
        key = "async" if asynchronous else "sync"
        out[f"{key}_first_blocked_s"] = blocked[0]
        out[f"{key}_blocked_s"] = statistics.median(blocked[1:])
        out[f"{key}_published_s"] = statistics.median(published[1:])
        if dist.get_rank() == 0:
            latest = root / f"step_{TIMED_SAVES + 1:08d}"
            files = [p for p in latest.rglob("*") if p.is_file()]
            out[f"{key}_bytes"] = sum(p.stat().st_size for p in files)
            out[f"{key}_tensor_bytes"] = sum(
                p.stat().st_size for p in files if p.suffix == ".distcp"
            )
        root = root.with_name(root.name + "-async")
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    destroy()


def run(quick: bool = False, shape: str | None = None) -> dict:
    from vapo_megatron.launch.local_launch import run_local_ranks

    shape = shape or "tiny"
    rows = []
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["PYTHONWARNINGS"] = "ignore"
    with tempfile.TemporaryDirectory() as tmp:
        for distopt in (True,) if shape == "medium" else (True, False):
            for world in (1, 2):
                root = Path(tmp) / f"w{world}-{distopt}"
                command = [sys.executable, __file__, WORKER_FLAG, shape, str(root), str(distopt)]
                outputs = run_local_ranks(command, world, timeout=1200, env=env, cwd=ROOT)
                line = next(x for x in outputs[0].splitlines() if x.startswith("RESULT "))
                rows.append(json.loads(line.removeprefix("RESULT ")))
    print(f"shape {shape}: {SHAPES[shape]}")
    head = ("optimizer", "DP", "bytes", "tensor bytes", "sync blocked s", "async blocked s",
            "async first s", "async published s")  # fmt: skip
    print("  ".join(f"{h:>16}" for h in head))
    for r in rows:
        cells = ("distributed" if r["distopt"] else "plain", r["world"], r["sync_bytes"],
                 r["sync_tensor_bytes"], f"{r['sync_blocked_s']:.3f}", f"{r['async_blocked_s']:.3f}",
                 f"{r['async_first_blocked_s']:.3f}", f"{r['async_published_s']:.3f}")  # fmt: skip
        print("  ".join(f"{c:>16}" for c in cells))
    result = {"bench": "checkpoint", "shape": shape, "rows": rows}
    print(json.dumps(result))
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == WORKER_FLAG:
        _worker(sys.argv[2], Path(sys.argv[3]), sys.argv[4] == "True")
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    args = parser.parse_args()
    run(shape=args.shape)


if __name__ == "__main__":
    main()
