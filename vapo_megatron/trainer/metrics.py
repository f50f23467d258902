"""Where a run's metrics go: a JSONL file always, tensorboard and wandb when configured, and
one readable line per step (with a progress bar) on rank 0's console. Only rank 0 logs."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger("vapo_megatron")

CONSOLE_KEYS = (
    ("score", "score", "{:+.3f}"),
    ("acc", "acc", "{:.3f}"),
    ("response_length/mean", "len", "{:.0f}"),
    ("policy/pg_loss", "pg", "{:+.4f}"),
    ("critic/value_loss", "vf", "{:.4f}"),
    ("critic/explained_variance", "ev", "{:+.3f}"),
    ("policy/clip_frac_high", "clip_hi", "{:.3f}"),
    ("rollout/logprob_gap", "gap", "{:.1e}"),
    ("policy/route_agreement", "routes", "{:.3f}"),  # MoE routing replay (step/updates.py)
    ("policy/mtp_loss", "mtp", "{:.3f}"),  # MTP layers trained (policy.mtp.loss_weight > 0)
    ("time/step", "s", "{:.1f}"),
)


class MetricsLogger:
    """Per-step metrics of rank 0. ``log(step, metrics)`` writes every sink; ``close()`` at end."""

    def __init__(
        self,
        run_dir: Path,
        *,
        total_steps: int,
        start_step: int,
        tensorboard: bool,
        wandb_project: str | None,
        progress_bar: bool,
        config: dict[str, Any],
        enabled: bool,
    ) -> None:
        self.enabled = enabled
        self.jsonl_path = run_dir / "metrics.jsonl"
        if not enabled:
            return
        self.jsonl = self.jsonl_path.open("a")
        self.tensorboard = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"))
        self.wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError as err:
                raise ValueError(
                    "trainer.wandb_project is set but wandb is not installed: pip install "
                    "-e .[wandb], or set trainer.wandb_project=null"
                ) from err
            self.wandb = wandb.init(
                project=wandb_project, dir=str(run_dir), config=config, resume="allow",
                id=run_dir.name,
            )  # fmt: skip
        self.bar = None
        if progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_steps, initial=start_step, desc="vapo", unit="step",
                file=sys.stderr, dynamic_ncols=True,
            )  # fmt: skip

    def log(self, step: int, metrics: dict[str, float], *, phase: str) -> None:
        if not self.enabled:
            return
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in metrics.items()
        }
        self.jsonl.write(json.dumps({"step": step, "phase": phase, **clean}, sort_keys=True) + "\n")
        self.jsonl.flush()
        if self.tensorboard is not None:
            for name, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.tensorboard.add_scalar(f"{phase}/{name}", value, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log({f"{phase}/{k}": v for k, v in metrics.items()}, step=step)
        keys = CONSOLE_KEYS + tuple(
            (key, key, "{:.3f}") for key in sorted(metrics) if key.startswith(("avg@", "pass@"))
        )
        line = f"[{phase} {step}] " + " ".join(
            f"{short}={fmt.format(metrics[key])}"
            for key, short, fmt in keys
            if isinstance(metrics.get(key), (int, float)) and math.isfinite(metrics[key])
        )
        if self.bar is not None:
            self.bar.write(line)
            if phase == "train":
                self.bar.update(1)
        else:
            logger.info(line)

    def close(self) -> None:
        if not self.enabled:
            return
        self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.bar is not None:
            self.bar.close()
