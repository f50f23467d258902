"""The tiny recipe's training step, phase by phase, and our own overhead.

Runs ``recipes/tiny_cpu.yaml`` (policy TP 2, critic TP 1, one vLLM-CPU engine per rank, 2 local
gloo ranks) for a few VAPO steps with a checkpoint every step, then reads the run's metrics.
Overhead is everything but vLLM generation and Megatron forward/backward/optimizer: the
weight sync, grading, packing, the scoring gathers, GAE, metric reductions and checkpoints.
The first step is left out (start-up: vLLM's first batch, allocator warm-up).
Target: overhead at most 10% of the step. Last line JSON {"bench": "step", "overhead_fraction": ...}.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASES = ("sync", "rollout", "reward", "rollout_other", "scoring", "advantages",
          "update_critic", "update_policy")  # fmt: skip


def run(quick: bool = False) -> dict:
    from vapo_megatron.config.recipe import load_recipe
    from vapo_megatron.launch.local_launch import run_local_ranks

    steps = 3 if quick else 6
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        assets = Path(tmp) / "assets"
        overrides = [
            f"model.path={assets / 'model'}", f"data.train_path={assets / 'train.jsonl'}",
            f"data.eval_path={assets / 'eval.jsonl'}", f"trainer.run_dir={run_dir}",
            f"trainer.steps={steps}", "trainer.checkpoint_every=1", "trainer.progress_bar=false",
            "algorithm.value_pretrain_steps=0", "eval.at_end=false", "trainer.export_hf=false",
            "trainer.tensorboard=false",
        ]  # fmt: skip
        config = load_recipe(ROOT / "recipes" / "tiny_cpu.yaml", overrides)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        run_local_ranks(
            [sys.executable, str(ROOT / "vapo_megatron" / "train.py"),
             str(ROOT / "recipes" / "tiny_cpu.yaml"), *overrides],
            config.trainer.local_world_size, timeout=1200, env=env, cwd=ROOT,
        )  # fmt: skip
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["phase"] == "train" and r["step"] > 1]
    saves = {r["step"]: r["seconds"] for r in rows if r["phase"] == "checkpoint"}
    step_seconds = sum(r["time/step"] for r in train)
    checkpoint_seconds = sum(saves.get(r["step"], 0.0) for r in train)
    total = step_seconds + checkpoint_seconds
    generate = sum(r["time/rollout"] for r in train)
    megatron = sum(r["time/megatron"] for r in train)
    overhead = total - generate - megatron
    print(f"tiny recipe, steps 2..{steps} ({len(train)} steps), 2 ranks, seconds per step:")
    print(f"{'phase':<16}{'mean s':>10}{'share':>9}")
    for phase in PHASES:
        mean = statistics.mean(r.get(f"time/{phase}", 0.0) for r in train)
        print(f"{phase:<16}{mean:>10.3f}{mean * len(train) / total:>9.1%}")
    print(f"{'checkpoint':<16}{checkpoint_seconds / len(train):>10.3f}"
          f"{checkpoint_seconds / total:>9.1%}")  # fmt: skip
    print(f"{'vLLM generate':<16}{generate / len(train):>10.3f}{generate / total:>9.1%}")
    print(f"{'Megatron f/b+opt':<16}{megatron / len(train):>10.3f}{megatron / total:>9.1%}")
    print(f"{'our overhead':<16}{overhead / len(train):>10.3f}{overhead / total:>9.1%}")
    result = {
        "bench": "step",
        "overhead_fraction": round(overhead / total, 4),
        "generate_fraction": round(generate / total, 4),
        "megatron_fraction": round(megatron / total, 4),
        "checkpoint_fraction": round(checkpoint_seconds / total, 4),
        "seconds_per_step": round(total / len(train), 3),
        "tokens_per_second": round(statistics.mean(r["tokens_per_second"] for r in train), 1),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    run(quick="--quick" in sys.argv)
