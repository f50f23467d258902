"""Helpers for the trainer's integration tests: tiny assets once per session, runs of
``vapo-train`` as local gloo ranks, and reading a run's metrics."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.launcher import REPO_ROOT, run_workers

TRAIN = REPO_ROOT / "vapo_megatron" / "train.py"
TINY = REPO_ROOT / "recipes" / "tiny_cpu.yaml"
# Every train step logs these (with a critic; GRPO/DAPO lack the critic/... and lambda ones).
STEP_KEYS = (
    "score", "acc", "response_length/mean", "response_length/max", "response_length/clip_frac",
    "rollout/logprob_gap", "rollout/rounds", "rollout/grader_timeouts", "policy/pg_loss",
    "policy/clip_frac_low", "policy/clip_frac_high", "policy/approx_kl", "policy/entropy",
    "policy/nll_positive", "policy/grad_norm", "critic/value_loss", "critic/grad_norm",
    "critic/explained_variance", "lambda_policy/mean", "lambda_policy/min", "lambda_policy/max",
    "time/rollout", "time/update_policy", "time/step", "tokens_per_second",
)  # fmt: skip


def make_assets(root: Path) -> dict[str, str]:
    """The tiny task's splits and a random-weight tiny model under ``root``; recipe overrides."""
    from vapo_megatron.tiny.model import write_tiny_model
    from vapo_megatron.tiny.synthetic import make_splits

    train, eval_ = make_splits(root, 400, 40, seed=0)
    write_tiny_model(root / "model", seed=0, train_path=train, template="raw")
    return {"model.path": str(root / "model"), "data.train_path": str(train),
            "data.eval_path": str(eval_), "model.create_tiny": "false"}  # fmt: skip


def run_trainer(
    run_dir: Path, assets: dict[str, str], world: int, *overrides: str, timeout: float = 420
) -> list[str]:
    """``vapo-train tiny_cpu.yaml`` with the assets, ``run_dir`` and overrides, as ``world``
    local ranks; returns each rank's output (AssertionError with the logs on failure)."""
    args = [f"{k}={v}" for k, v in assets.items()]
    args += [f"trainer.run_dir={run_dir}", "trainer.progress_bar=false", *overrides]
    return run_workers(TRAIN, world, str(TINY), *args, timeout=timeout)


def plain_command(run_dir: Path, assets: dict[str, str], *overrides: str) -> list[str]:
    """The command a user types (the trainer starts its own local ranks)."""
    args = [f"{k}={v}" for k, v in assets.items()]
    return [sys.executable, str(TRAIN), str(TINY), *args, f"trainer.run_dir={run_dir}",
            "trainer.progress_bar=false", *overrides]  # fmt: skip


def plain_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONWARNINGS"] = "ignore::UserWarning,ignore::FutureWarning"
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def read_metrics(run_dir: Path, phase: str = "train") -> dict[int, dict]:
    """The last logged metrics of each step of ``phase`` (a resumed run may log a step twice)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["phase"] == phase:
            out[row["step"]] = row
    return out
