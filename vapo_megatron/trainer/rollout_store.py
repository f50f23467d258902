"""Rollouts saved during critic pretraining, and read back to fit a critic offline.

``critic_pretrain.save_rollouts`` writes each pretraining step's graded trajectories to
``RUN_DIR/rollouts/step_{k:06d}.pt`` (rank 0, written to a temporary name and renamed);
``critic_pretrain.offline_rollouts: DIR`` makes pretraining step k fit the k-th saved file
(cycling when there are fewer files than steps) instead of sampling from the policy.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from vapo_megatron.parallel.devices import HOST
from vapo_megatron.trainer.rollout_phase import Trajectories


def save_rollouts(directory: Path, index: int, trajectories: Trajectories) -> Path:
    """Rank 0 only: one file of plain tensors (no pickled classes)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{index:06d}.pt"
    tmp = path.with_suffix(".pt.tmp")
    state = {
        "meta": trajectories.meta_rows(),
        "reward": trajectories.reward,
        "prompt_tokens": trajectories.prompts.values,
        "response_tokens": trajectories.responses.values,
        "rollout_logprobs": trajectories.rollout_logprobs,
    }
    torch.save(state, tmp)
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


def load_rollouts(directory: str | Path, index: int) -> Trajectories:
    """The trajectories of saved step ``index`` (1-based), cycling over the files. Files of
    the earlier format (a list of one dict per trajectory) load too."""
    files = rollout_files(directory)
    path = files[(index - 1) % len(files)]
    state = torch.load(path, weights_only=True, map_location=HOST)
    if isinstance(state, list):
        state = _from_rows_of_dicts(state)
    out = Trajectories.from_rows(
        state["meta"], state["prompt_tokens"], state["response_tokens"], state["rollout_logprobs"]
    )
    out.reward = state["reward"]
    return out


def _from_rows_of_dicts(rows: list[dict]) -> dict[str, torch.Tensor]:
    meta = [
        (r["group"], r["prompt_index"], len(r["prompt"]), len(r["response"]), r["truncated"],
         r["score"], r["acc"])
        for r in rows
    ]  # fmt: skip
    return {
        "meta": torch.tensor(meta, dtype=torch.float64, device=HOST).reshape(len(rows), 7),
        "reward": torch.tensor([r["reward"] for r in rows], dtype=torch.float64, device=HOST),
        "prompt_tokens": torch.tensor(
            [x for r in rows for x in r["prompt"]], dtype=torch.int32, device=HOST
        ),
        "response_tokens": torch.tensor(
            [x for r in rows for x in r["response"]], dtype=torch.int32, device=HOST
        ),
        "rollout_logprobs": torch.tensor(
            [x for r in rows for x in r["rollout_logprobs"]], dtype=torch.float32, device=HOST
        ),
    }
