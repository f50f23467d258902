"""Writes the tiny demo's inputs: the synthetic task's splits and a tiny Qwen2 model directory.

    python tools/make_tiny.py OUT_DIR [--seed 0] [--warmup-steps N] [--slip-rate X] [--guess-rate X] [--n-train 2000 --n-eval 200]

OUT_DIR/train.jsonl and OUT_DIR/eval.jsonl (plain rows, graded by DAPO's grader), OUT_DIR/model
(tokenizer + Qwen2ForCausalLM, a complete HF directory). Prints one JSON line: paths, sizes,
wall and CPU seconds, and the eval pass rate (greedy and temperature 1) when a warm-up ran.
When OUT_DIR already holds outputs made with the same parameters (OUT_DIR/stamp.json) nothing
is redone and the recorded line is printed again, with "reused": true. recipes/demo.yaml's
model (shipped in vapo_megatron/tiny/demo): --warmup-steps 8000 --slip-rate 0.15
--guess-rate 0.5 --template raw (~700 CPU seconds; 18% pass at temperature 1 on the eval
split); 0 steps leaves the random model (0%).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

STAMP_VERSION = 2
"""Bump when the task, tokenizer or model changes, so old outputs are rebuilt."""


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument(
        "--slip-rate", type=float, default=0.0, help="warm-up lines that slip (0 <= x < 1)"
    )
    parser.add_argument(
        "--guess-rate", type=float, default=0.0, help="warm-up answers guessed (0 <= x < 1)"
    )
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--n-eval", type=int, default=200)
    parser.add_argument("--template", choices=("dapo", "raw"), default="dapo")
    parser.add_argument("--eval-prompts", type=int, default=200, help="prompts for the pass rate")
    args = parser.parse_args()

    params = {"version": STAMP_VERSION, **{k: v for k, v in vars(args).items() if k != "out_dir"}}
    out_dir: Path = args.out_dir
    stamp_path = out_dir / "stamp.json"
    model_dir = out_dir / "model"
    outputs = (model_dir / "config.json", out_dir / "train.jsonl", out_dir / "eval.jsonl")
    if stamp_path.exists() and all(path.exists() for path in outputs):
        stamp = json.loads(stamp_path.read_text())
        if stamp["params"] == params:
            print(json.dumps({**stamp["result"], "reused": True}))
            return
    # Imported past the stamp check: torch and transformers take seconds to import, and
    # `make demo` calls this on every run.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vapo_megatron.tiny.model import pass_rate, write_tiny_model
    from vapo_megatron.tiny.synthetic import make_splits, read_rows

    start, start_cpu = time.perf_counter(), time.process_time()
    train_path, eval_path = make_splits(out_dir, args.n_train, args.n_eval, args.seed)
    write_tiny_model(
        model_dir,
        seed=args.seed,
        warmup_steps=args.warmup_steps,
        train_path=train_path,
        template=args.template,
        slip_rate=args.slip_rate,
        guess_rate=args.guess_rate,
    )
    result = {
        "model": str(model_dir),
        "train": str(train_path),
        "eval": str(eval_path),
        "n_train": args.n_train,
        "n_eval": args.n_eval,
        "model_mb": round((model_dir / "model.safetensors").stat().st_size / 2**20, 2),
        # What tools/demo.py checks before it uses a shipped copy, and what a rebuild must equal.
        "model_sha256": sha256(model_dir / "model.safetensors"),
        "train_sha256": sha256(train_path),
        "seconds": round(time.perf_counter() - start, 2),
        # CPU seconds of this process: what the build costs when the cores are shared.
        "cpu_seconds": round(time.process_time() - start_cpu, 2),
    }
    if args.warmup_steps > 0:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        rows = read_rows(eval_path)[: args.eval_prompts]
        for name, temperature in (("pass_rate_greedy", 0.0), ("pass_rate_t1", 1.0)):
            rate = pass_rate(
                model,
                tokenizer,
                rows,
                temperature=temperature,
                seed=args.seed,
                template=args.template,
            )
            result[name] = round(rate, 4)
    stamp_path.write_text(json.dumps({"params": params, "result": result}, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
