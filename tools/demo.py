"""`make demo`: a tiny Qwen2 learns the synthetic arithmetic task with VAPO, every real part in the path.

    python tools/demo.py [--recipe recipes/demo.yaml] [--fresh] [section.key=value ...]

1. Assets: the task's train and held-out splits, a BPE tokenizer and a tiny Qwen2 warmed up by
   supervised steps from random weights (model.tiny_warmup_steps), then tools/convert.py
   hf-to-mcore of that policy at the policy's layout (the run loads it through policy.load).
   Built once; a stamp next to the model says with which values, and other values rebuild.
2. vapo-train on the recipe: critic pretraining, held-out evaluation before the first step,
   the VAPO steps, evaluation after the last, HF export; its console (a progress bar and a line
   per step) is this one.
3. The curves (tools/plot_curves.py) and RUN_DIR/summary.json: the trainer's summary plus
   pass_rate_before / pass_rate_after (avg@k over the held-out prompts) with their standard
   errors, steps and the demo's seconds.

Over an existing run directory it resumes from the run's last checkpoint, shows a finished
run's results without training again, or with --fresh deletes it and starts over; the console
says which. Exit status: 0 done, 1 a step failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from vapo_megatron.run_log import quiet_dependencies  # noqa: E402
from vapo_megatron.train import check_before_ranks  # noqa: E402

quiet_dependencies()

from make_tiny import sha256  # noqa: E402
from plot_curves import plot_curves, read_metrics  # noqa: E402

from vapo_megatron.checkpoint.directory import latest_step  # noqa: E402
from vapo_megatron.config.recipe import load_recipe  # noqa: E402
from vapo_megatron.config.train import TrainConfig  # noqa: E402

DEFAULT_RECIPE = REPO_ROOT / "recipes" / "demo.yaml"
CONVERT = REPO_ROOT / "tools" / "convert.py"
SHIPPED_MODEL = REPO_ROOT / "vapo_megatron" / "tiny" / "demo"
"""tools/make_tiny.py's output for recipes/demo.yaml's values, so `make demo` skips the warm-up."""
ASSETS_STAMP_VERSION = 2
"""Bump when what the assets are made of changes, so old ones are rebuilt."""


def prepare_assets(config: TrainConfig, *, log=print) -> dict[str, float]:
    """Builds the task's splits, the warmed-up tiny model and its Megatron checkpoint where
    missing or made with other values; returns the seconds each part took (0 when reused)."""
    from vapo_megatron.tiny.model import write_tiny_model
    from vapo_megatron.tiny.synthetic import make_splits

    model, data = config.model, config.data
    train_path, eval_path = Path(data.train_path), Path(data.eval_path or "")
    if eval_path.parent != train_path.parent or (train_path.name, eval_path.name) != (
        "train.jsonl",
        "eval.jsonl",
    ):
        raise ValueError(
            f"the tiny task is written as DIR/train.jsonl and DIR/eval.jsonl; got "
            f"data.train_path={train_path}, data.eval_path={data.eval_path}"
        )
    model_dir, mcore_dir = Path(model.path), converted_policy_dir(config)
    stamp_path = model_dir.parent / "demo_assets.json"
    params = {
        "version": ASSETS_STAMP_VERSION, "seed": model.tiny_seed,
        "warmup_steps": model.tiny_warmup_steps, "slip_rate": model.tiny_slip_rate,
        "guess_rate": model.tiny_guess_rate, "num_train": model.tiny_num_train,
        "num_eval": model.tiny_num_eval, "template": data.template, "data_dir": str(train_path.parent),
        "tp": config.policy.layout.tp, "pp": config.policy.layout.pp, "dtype": config.model.dtype,
    }  # fmt: skip
    stamp = json.loads(stamp_path.read_text()) if stamp_path.is_file() else None
    built = {"assets_seconds": 0.0, "convert_seconds": 0.0}
    have_model = (model_dir / "config.json").is_file() and train_path.is_file()
    if stamp is not None and stamp["params"] == params and have_model:
        log(f"demo: assets reused from {model_dir.parent} ({stamp['note']})")
    else:
        started = time.perf_counter()
        log(f"demo: writing the tiny task in {train_path.parent}")
        for stale in (model_dir, mcore_dir):
            shutil.rmtree(stale, ignore_errors=True)
        make_splits(train_path.parent, model.tiny_num_train, model.tiny_num_eval, model.tiny_seed)
        shipped = shipped_model(config, train_path)
        if shipped is not None:
            shutil.copytree(shipped, model_dir)
            note = f"warmed-up model copied from {shipped.relative_to(REPO_ROOT)} (its values)"
        else:
            log(
                f"demo: warming up the tiny model ({model.tiny_warmup_steps} supervised steps "
                f"from random weights; no shipped copy has these values) in {model_dir}"
            )
            write_tiny_model(
                model_dir, seed=model.tiny_seed, warmup_steps=model.tiny_warmup_steps,
                train_path=train_path, template=data.template, slip_rate=model.tiny_slip_rate,
                guess_rate=model.tiny_guess_rate,
            )  # fmt: skip
            note = "built"
        built["assets_seconds"] = time.perf_counter() - started
        note = f"{note} in {built['assets_seconds']:.0f} s"
        stamp_path.write_text(json.dumps({"params": params, "note": note}, indent=2) + "\n")
        log(f"demo: tiny task and model: {note}")
    if not (mcore_dir / "vapo_checkpoint.json").is_file():
        started = time.perf_counter()
        layout = config.policy.layout
        dtype = {"float32": "fp32", "bfloat16": "bf16"}[config.model.dtype]
        command = [
            sys.executable, str(CONVERT), "hf-to-mcore", "--hf", str(model_dir),
            "--out", str(mcore_dir), "--tp", str(layout.tp), "--pp", str(layout.pp),
            "--dtype", dtype, "--force",
        ]  # fmt: skip
        log(f"demo: tools/convert.py hf-to-mcore -> {mcore_dir} (TP {layout.tp}, PP {layout.pp})")
        done = subprocess.run(command, env=_env(), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"tools/convert.py failed:\n{done.stdout}\n{done.stderr}")
        built["convert_seconds"] = time.perf_counter() - started
    return built


def shipped_model(config: TrainConfig, train_path: Path) -> Path | None:
    """The repository's copy of the warmed-up model when it was made with the recipe's values.

    ``SHIPPED_MODEL`` holds what ``tools/make_tiny.py`` wrote (its ``stamp.json`` records the
    values and the SHA-256 of the weights and of the train split it was warmed up on); it is
    used only when the values match and the freshly written train split is the same bytes,
    otherwise the model is built (``model.tiny_warmup_steps`` supervised steps).
    """
    stamp_path = SHIPPED_MODEL / "stamp.json"
    if not stamp_path.is_file():
        return None
    stamp = json.loads(stamp_path.read_text())
    model, wanted = config.model, stamp["params"]
    ours = {
        "seed": model.tiny_seed, "warmup_steps": model.tiny_warmup_steps,
        "slip_rate": model.tiny_slip_rate, "guess_rate": model.tiny_guess_rate,
        "n_train": model.tiny_num_train,
        "n_eval": model.tiny_num_eval, "template": config.data.template,
    }  # fmt: skip
    if any(wanted.get(key) != value for key, value in ours.items()):
        return None
    if sha256(train_path) != stamp["result"]["train_sha256"]:
        return None
    if sha256(SHIPPED_MODEL / "model" / "model.safetensors") != stamp["result"]["model_sha256"]:
        raise RuntimeError(f"{SHIPPED_MODEL}/model/model.safetensors does not match its stamp")
    return SHIPPED_MODEL / "model"


def converted_policy_dir(config: TrainConfig) -> Path:
    """Where tools/convert.py writes the policy: policy.load, else next to model.path."""
    return Path(config.policy.load or Path(config.model.path).parent / "policy_mcore")


def run_trainer(recipe: Path, overrides: list[str]) -> int:
    """vapo-train on this console (it starts its own local ranks); returns its exit status."""
    command = [sys.executable, "-m", "vapo_megatron.train", str(recipe), *overrides]
    return subprocess.run(command, env=_env()).returncode


def pass_rate(eval_row: dict) -> dict[str, float]:
    """avg@k of one eval row, with its standard error over prompts.

    When the trainer logs ``avg@k/stderr`` (the spread of per-prompt accuracies) it is used;
    otherwise the bound sqrt(p (1 - p) / prompts), which holds because a per-prompt mean of
    0/1 accuracies has variance at most p (1 - p) (reached when a prompt's k samples agree);
    at k = 1 it is exact.
    """
    key = next(k for k in eval_row if k.startswith("avg@") and "/" not in k)
    rate, prompts = eval_row[key], eval_row["num_prompts"]
    stderr = eval_row.get(f"{key}/stderr")
    # At k = 1 the bound is the binomial standard error itself.
    measured = stderr is not None or key == "avg@1"
    if stderr is None:
        stderr = math.sqrt(rate * (1 - rate) / max(prompts, 1))
    return {"rate": rate, "stderr": stderr, "stderr_measured": measured, "metric": key,
            "num_prompts": prompts}  # fmt: skip


def summarize(run_dir: Path, seconds: float, extra: dict) -> dict:
    """The trainer's summary.json plus the demo's pass rates, steps and seconds."""
    trainer_summary = json.loads((run_dir / "summary.json").read_text())
    evals = read_metrics(run_dir / "metrics.jsonl").get("eval", {})
    if 0 not in evals:
        raise RuntimeError(f"{run_dir}/metrics.jsonl has no evaluation before step 1")
    steps = trainer_summary["steps"]
    before, after = pass_rate(evals[0]), pass_rate(evals[steps])
    gain = after["rate"] - before["rate"]
    return {
        **trainer_summary,
        "pass_rate_before": before["rate"],
        "pass_rate_before_stderr": before["stderr"],
        "pass_rate_after": after["rate"],
        "pass_rate_after_stderr": after["stderr"],
        "gain_points": 100 * gain,
        "gain_stderr_points": 100 * math.hypot(before["stderr"], after["stderr"]),
        "stderr": "over prompts" if after["stderr_measured"] else "upper bound",
        "eval_metric": after["metric"],
        "eval_prompts": after["num_prompts"],
        "steps": steps,
        "seconds": seconds,
        "train_seconds": trainer_summary["seconds"],
        **extra,
    }


def outputs(run_dir: Path) -> list[Path]:
    events = sorted((run_dir / "tensorboard").glob("events.*"))
    files = [run_dir / "metrics.jsonl", *events, run_dir / "curves.png", run_dir / "summary.json"]
    return [*files, run_dir / "hf_policy"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE)
    parser.add_argument("--fresh", action="store_true", help="delete the run directory first")
    parser.add_argument("overrides", nargs="*", help="section.key=value, as for vapo-train")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        config = load_recipe(args.recipe, args.overrides)
        # Before --fresh deletes anything and the warm-up trains for minutes: vapo-train's
        # own refusal (again once the model is built, against it).
        check_before_ranks(config, config.trainer.local_world_size)
        run_dir = Path(config.trainer.run_dir)
        summary_path = run_dir / "summary.json"
        done = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        start = "fresh"
        if args.fresh and run_dir.exists():
            shutil.rmtree(run_dir)
            print(f"demo: --fresh: deleted {run_dir}; starting fresh")
        elif "pass_rate_after" in done and done["steps"] == config.trainer.steps:
            print(f"demo: {run_dir} holds a finished run; showing it (--fresh to train again)")
            return _report(run_dir, done)
        elif (step := latest_step(run_dir / "checkpoints")) is not None:
            start = "resumed"
            print(
                f"demo: resuming {run_dir} from its checkpoint {step} (critic pretraining and "
                "VAPO steps count together; --fresh to start over)"
            )
        else:
            if run_dir.exists():
                shutil.rmtree(run_dir)  # no checkpoint: nothing to resume, only stale logs
            print(f"demo: starting fresh in {run_dir}")
        built = prepare_assets(config)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"demo: {err}", file=sys.stderr)
        return 1
    status = run_trainer(args.recipe, args.overrides)
    if status != 0:
        print(f"demo: vapo-train failed (exit {status}); logs in {run_dir}/logs", file=sys.stderr)
        return status
    plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png", title=f"VAPO demo: {run_dir}")
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu_seconds = sum(u.ru_utime + u.ru_stime for u in usage)
    summary = summarize(
        run_dir,
        time.perf_counter() - started,
        {**built, "cpu_seconds": cpu_seconds, "start": start},
    )
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    return _report(run_dir, summary)


def _report(run_dir: Path, summary: dict) -> int:
    before, after = summary["pass_rate_before"], summary["pass_rate_after"]
    print(
        f"demo: held-out pass rate ({summary['eval_metric']}, {summary['eval_prompts']:.0f} "
        f"prompts) {100 * before:.1f}% -> {100 * after:.1f}% ({summary['gain_points']:+.1f} "
        f"points, standard error {summary['gain_stderr_points']:.1f}, {summary['stderr']}) "
        f"after {summary['steps']} steps in {summary['seconds']:.0f} s"
    )
    print("demo: outputs")
    for path in outputs(run_dir):
        print(f"  {path}")
    return 0


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHONWARNINGS", "ignore::UserWarning,ignore::FutureWarning")
    return env


if __name__ == "__main__":
    sys.exit(main())
