"""Rollouts saved during critic pretraining, and read back to fit a critic offline.

``critic_pretrain.save_rollouts`` writes each pretraining step's graded trajectories to
``RUN_DIR/rollouts/step_{k:06d}.pt`` (rank 0, written to a temporary name and renamed);
``critic_pretrain.offline_rollouts: DIR`` makes pretraining step k fit the k-th saved file
(cycling when there are fewer files than steps) instead of sampling from the policy.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from vapo_megatron.trainer.rollout_phase import Trajectory


def save_rollouts(directory: Path, index: int, trajectories: list[Trajectory]) -> Path:
    """Rank 0 only: one file of plain dicts (no pickled classes)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{index:06d}.pt"
    tmp = path.with_suffix(".pt.tmp")
    torch.save([dataclasses.asdict(t) for t in trajectories], tmp)
    os.replace(tmp, path)
    return path


def rollout_files(directory: str | Path) -> list[Path]:
    files = sorted(Path(directory).glob("step_*.pt"))
    if not files:
        raise ValueError(
            f"critic_pretrain.offline_rollouts={directory} holds no step_*.pt files; point it at "
            "the rollouts/ directory of a run with critic_pretrain.save_rollouts=true"
        )
    return files


def load_rollouts(directory: str | Path, index: int) -> list[Trajectory]:
    """The trajectories of saved step ``index`` (1-based), cycling over the files."""
    files = rollout_files(directory)
    rows = torch.load(files[(index - 1) % len(files)], weights_only=True)
    return [Trajectory(**row) for row in rows]
