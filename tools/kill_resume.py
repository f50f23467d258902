"""kill -9 a tiny training run anywhere, resume it, and compare it with a run never killed.

A reference run of ``recipes/tiny_cpu.yaml`` (critic pretraining, VAPO steps, a checkpoint every
step) runs to the end. The same run is then started, killed with SIGKILL on its whole process
group (the launcher, every rank, vLLM, the background checkpoint writer), and started again
with the same command, once per planned kill, and finally left to finish. Every logged metric
of the critic-pretraining and train steps (timings excepted) must equal the reference's: the
last value logged for each step counts, since a resumed run logs again the steps it redoes.

Kills are planned as events seen in the run directory (polled every 10 ms) or times:

    published:N       checkpoint step_N was just renamed into place (its marker is written)
    writing           a checkpoint's temporary directory appeared (a save is writing)
    exporting         the pretrained critic's temporary export directory appeared
    exported          RUN_DIR/critic_pretrained appeared
    after:SECONDS     that long after the start
    stepping:SECONDS  that long after this start logged its first step
    startup           a uniform time in the reference's start-up (before its first step)
    random            stepping: a uniform time up to 40% of the reference's stepping time
                      (from its first logged step to its end): the kill lands among the steps,
                      and each start gets a part of the way, so several kills fit in one run

For each kill the tool prints where the run was (last logged step, checkpoints, saves being
written, the critic export), then one JSON line: the kills, the differences and failed starts.

    python tools/kill_resume.py OUT_DIR --kills startup,random,published:3,exported,random \\
        [--async] [--seed 0] [--steps 3] [-- recipe overrides...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE = REPO_ROOT / "recipes" / "tiny_cpu.yaml"
TRAIN = REPO_ROOT / "vapo_megatron" / "train.py"
PHASES = ("critic_pretrain", "train")
START_TIMEOUT = 600.0  # one start of the tiny run, reference included (2 cores, shared)


def command(run_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, str(TRAIN), str(RECIPE), *overrides,
            f"trainer.run_dir={run_dir}", "trainer.progress_bar=false"]  # fmt: skip


def start(run_dir: Path, overrides: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    with open(log, "a") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            command(run_dir, overrides), cwd=REPO_ROOT, env=env, stdout=out,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class Watch:
    """What one start of the run has done so far, as the run directory shows it."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.started = run_dir, time.monotonic()
        self.rows_at_start = logged_rows(run_dir)
        self.first_row: float | None = None  # seconds after the start

    def poll(self) -> None:
        if self.first_row is None and logged_rows(self.run_dir) > self.rows_at_start:
            self.first_row = time.monotonic() - self.started

    def seen(self, event: str) -> bool:
        ckpts = self.run_dir / "checkpoints"
        kind, _, arg = event.partition(":")
        elapsed = time.monotonic() - self.started
        if kind == "published":
            return (ckpts / f"step_{int(arg):08d}" / "COMPLETE").is_file()
        if kind == "writing":
            return ckpts.is_dir() and any(".tmp-" in p.name for p in ckpts.iterdir())
        if kind == "exporting":
            return (self.run_dir / "critic_pretrained.tmp").is_dir()
        if kind == "exported":
            return (self.run_dir / "critic_pretrained").is_dir()
        if kind == "after":
            return elapsed >= float(arg)
        if kind == "stepping":
            return self.first_row is not None and elapsed >= self.first_row + float(arg)
        raise ValueError(f"unknown kill event {event!r}; see the tool's docstring")


def logged_rows(run_dir: Path) -> int:
    jsonl = run_dir / "metrics.jsonl"
    return jsonl.read_text().count("\n") if jsonl.is_file() else 0


def where(run_dir: Path) -> dict:
    """What the run directory showed at the kill."""
    ckpts = run_dir / "checkpoints"
    entries = sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []
    last = None
    jsonl = run_dir / "metrics.jsonl"
    if jsonl.is_file():
        lines = [json.loads(x) for x in jsonl.read_text().splitlines() if x.strip()]
        if lines:
            last = f"{lines[-1]['phase']} {lines[-1]['step']}"
    return {
        "last_logged": last,
        "complete": [e for e in entries if e.startswith("step_") and ".tmp-" not in e],
        "writing": [e for e in entries if ".tmp-" in e],
        "critic_export": (run_dir / "critic_pretrained").is_dir(),
        "critic_export_writing": (run_dir / "critic_pretrained.tmp").is_dir(),
    }


def run_until(event: str | None, run_dir: Path, overrides: list[str], log: Path) -> dict:
    """One start of the run; kill it at ``event`` (None: let it finish)."""
    watch = Watch(run_dir)
    proc = start(run_dir, overrides, log)
    while proc.poll() is None:
        watch.poll()
        elapsed = round(time.monotonic() - watch.started, 2)
        if elapsed > START_TIMEOUT:
            kill_group(proc)
            return {"event": event, "outcome": "timed out"}
        if event is not None and watch.seen(event):
            kill_group(proc)
            return {"event": event, "outcome": "killed", "at_s": elapsed, **where(run_dir)}
        time.sleep(0.002)
    outcome = "finished" if proc.returncode == 0 else f"failed (rc={proc.returncode})"
    if event is not None and outcome == "finished":
        outcome = "finished (event not seen)"
    at_s = round(time.monotonic() - watch.started, 2)
    return {"event": event, "outcome": outcome, "at_s": at_s, "first_step_s": watch.first_row}


def metrics(run_dir: Path) -> dict[tuple[str, int], dict]:
    """The last row logged for each (phase, step) of the compared phases, timings left out."""
    rows = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["phase"] in PHASES:
            rows[row["phase"], row["step"]] = {k: v for k, v in row.items() if not timing(k)}
    return rows


def timing(key: str) -> bool:
    return key.startswith("time/") or key in ("tokens_per_second", "overhead_fraction")


def differences(want: dict, got: dict) -> list[str]:
    out = []
    for key in sorted(set(want) | set(got)):
        if key not in got or key not in want:
            out.append(f"{key}: only in the {'reference' if key in want else 'killed run'}")
            continue
        for name in sorted(set(want[key]) | set(got[key])):
            a, b = want[key].get(name), got[key].get(name)
            same = a == b or (
                isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
            )
            if not same:
                out.append(f"{key[0]} {key[1]} {name}: {a} (reference) vs {b} (killed run)")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--kills", default="startup,writing,published:3,exported,random,random,random"
    )
    parser.add_argument("--async", dest="asynchronous", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.overrides = argv[cut + 1 :]  # recipe overrides, after --
    rng = random.Random(args.seed)
    overrides = [
        f"trainer.steps={args.steps}", "trainer.checkpoint_every=1", "trainer.keep_last=100",
        f"trainer.checkpoint_async={str(args.asynchronous).lower()}", "eval.at_end=false",
        "trainer.export_hf=false", *args.overrides,
    ]  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    reference = run_until(None, args.out / "reference", overrides, args.out / "reference.log")
    print(f"reference: {reference['outcome']} in {reference['at_s']} s", flush=True)
    if reference["outcome"] != "finished":
        print(json.dumps({"ok": False, "reference": reference}))
        return 1
    killed_dir, log = args.out / "killed", args.out / "killed.log"
    results = []
    startup = reference["first_step_s"]
    for event in args.kills.split(","):
        if event == "random":
            event = f"stepping:{rng.uniform(0.0, 0.4 * (reference['at_s'] - startup)):.2f}"
        elif event == "startup":
            event = f"after:{rng.uniform(1.0, startup):.2f}"
        result = run_until(event, killed_dir, overrides, log)
        print(f"kill {len(results) + 1} at {event}: {json.dumps(result)}", flush=True)
        results.append(result)
    final = run_until(None, killed_dir, overrides, log)
    print(f"final start: {final['outcome']} in {final.get('at_s')} s", flush=True)
    ended = ("killed", "finished", "finished (event not seen)")
    failed = [r for r in [*results, final] if r["outcome"] not in ended]
    diffs = (
        differences(metrics(args.out / "reference"), metrics(killed_dir))
        if final["outcome"] == "finished"
        else []
    )
    for line in diffs[:40]:
        print("difference:", line)
    summary = {
        "ok": not failed and not diffs and final["outcome"] == "finished",
        "kills": results, "final": final, "differences": len(diffs), "failed_starts": len(failed),
        "compared_rows": len(metrics(args.out / "reference")),
    }  # fmt: skip
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
