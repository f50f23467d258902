"""Rollouts saved during critic pretraining, and read back to fit a critic offline.

``critic_pretrain.save_rollouts`` writes each pretraining step's graded trajectories to
``RUN_DIR/rollouts/step_{k:06d}.pt`` (rank 0, written to a temporary name and renamed);
``critic_pretrain.offline_rollouts: DIR`` makes pretraining step k fit the k-th saved file
(cycling when there are fewer files than steps) instead of sampling from the policy.
The engine's routes (routing replay) are not saved: they serve the policy's passes, and
critic pretraining trains the critic alone (an MoE critic records routes of its own).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from vapo_megatron.parallel.devices import HOST
from vapo_megatron.step.trajectories import META_FIELDS, Trajectories


def save_rollouts(directory: Path, index: int, trajectories: Trajectories) -> Path:
    """Rank 0 only: one file, a list of one plain dict per trajectory (no pickled classes).
    Token ids and log-probs are views of the step's flat buffers, which ``torch.save`` stores
    once, so the file costs no per-token Python objects."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{index:06d}.pt"
    tmp = path.with_suffix(".pt.tmp")
    t = trajectories
    scalars = zip(
        t.group.tolist(), t.prompt_index.tolist(), t.truncated.tolist(), t.score.tolist(),
        t.acc.tolist(), t.reward.tolist(), strict=True,
    )  # fmt: skip
    rows = []
    for i, (group, prompt_index, truncated, score, acc, reward) in enumerate(scalars):
        lo, hi = int(t.responses.offsets[i]), int(t.responses.offsets[i + 1])
        rows.append(
            {"group": group, "prompt_index": prompt_index, "prompt": t.prompts[i],
             "response": t.responses[i], "rollout_logprobs": t.rollout_logprobs[lo:hi],
             "truncated": truncated, "score": score, "acc": acc, "reward": reward}
        )  # fmt: skip
    torch.save(rows, tmp)
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
    """The trajectories of saved step ``index`` (1-based), cycling over the files. Files
    whose token ids and log-probs are lists (written before trajectories were tensors) load
    too."""
    files = rollout_files(directory)
    rows = torch.load(files[(index - 1) % len(files)], weights_only=True, map_location=HOST)
    meta = [
        (r["group"], r["prompt_index"], len(r["prompt"]), len(r["response"]), r["truncated"],
         r["score"], r["acc"])
        for r in rows
    ]  # fmt: skip
    out = Trajectories.from_rows(
        torch.tensor(meta, dtype=torch.float64, device=HOST).reshape(len(rows), len(META_FIELDS)),
        _flat([r["prompt"] for r in rows], torch.int32),
        _flat([r["response"] for r in rows], torch.int32),
        _flat([r["rollout_logprobs"] for r in rows], torch.float32),
    )
    out.reward = torch.tensor([r["reward"] for r in rows], dtype=torch.float64, device=HOST)
    return out


def _flat(parts: list, dtype: torch.dtype) -> torch.Tensor:
    """Rows given as tensors or lists, laid end to end as one [N] host tensor."""
    tensors = [torch.as_tensor(p, dtype=dtype, device=HOST) for p in parts]
    return torch.cat(tensors) if tensors else torch.zeros(0, dtype=dtype, device=HOST)
