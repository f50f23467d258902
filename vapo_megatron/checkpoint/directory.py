"""The training checkpoints' directory: which steps are complete, which one ``latest`` names,
publishing a fully written save (fsync, marker, rename, ``latest``) and pruning the old ones.
Plain files, no torch.distributed: rank 0 runs these. What a checkpoint holds is described in
``checkpoint/__init__.py``."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

FORMAT = "vapo-megatron-train-checkpoint"
FORMAT_VERSION = 2
OLD_FORMAT_COMMIT = "0427728"
"""The last commit that writes (and reads) format_version 1, the per-rank pickles."""
MARKER = "COMPLETE"
LATEST = "latest"
META = "meta.json"
EXTRA = "extra.pt"
RANK_EXTRA = "rank_extra"
"""Each rank's own part of the run's state (one file a rank), beside the RNG states."""
WEIGHTS = "weights"
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler.pt"
STEP_DIR = re.compile(r"step_(\d{8})")
TMP_DIR = re.compile(r"step_\d{8}\.tmp-.+")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_file(rank: int) -> str:
    """The name of rank ``rank``'s own file (its RNG states) in a checkpoint."""
    return f"rank_{rank:05d}.pt"


def complete_steps(root: str | os.PathLike) -> list[int]:
    """Steps of the complete checkpoints under ``root``, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = STEP_DIR.fullmatch(entry.name)
        if match and (entry / MARKER).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_step(root: str | os.PathLike) -> int | None:
    """The step a resume would load: ``latest``'s, or else (with a warning) the newest complete
    checkpoint's; None when there is none."""
    root = Path(root)
    complete = complete_steps(root)
    pointer = _read_latest(root)
    if pointer is not None and pointer in complete:
        return pointer
    if not complete:
        if pointer is not None:
            logger.warning("%s/%s names step %s, but no complete checkpoint", root, LATEST, pointer)
        return None
    named = "is missing or unreadable" if pointer is None else f"names step {pointer}, which is"
    if pointer is not None:
        named += " missing or incomplete"
    logger.warning(
        "%s/%s %s; using the newest complete checkpoint, step %d",
        root,
        LATEST,
        named,
        complete[-1],
    )
    return complete[-1]


def publish(tmp: Path, root: Path, step: int, *, keep_last: int) -> Path:
    """Make the fully written ``tmp`` the checkpoint of ``step``: fsync, mark complete, rename,
    point ``latest`` at it, then prune (see :func:`prune`). Returns its directory."""
    for dirpath, _, filenames in os.walk(tmp):
        for name in filenames:
            _fsync(Path(dirpath) / name)
    _write_durably(tmp / MARKER, json.dumps({"step": step}) + "\n")
    for dirpath, _, _ in os.walk(tmp, topdown=False):
        _fsync(Path(dirpath))
    final = root / step_dir_name(step)
    if final.exists():  # the same step saved again, by a run resumed from an earlier step
        final.rename(root / f"{final.name}.tmp-replaced-{tmp.name.rpartition('.tmp-')[2]}")
    tmp.rename(final)
    _fsync(root)
    _write_durably(root / LATEST, f"{step}\n")
    prune(root, keep_last=keep_last, current=step)
    return final


def prune(root: Path, *, keep_last: int, current: int) -> None:
    """Remove every ``.tmp-*`` directory and, with ``keep_last`` > 0, every step directory
    older than the ``keep_last`` newest complete checkpoints up to ``current``."""
    doomed = [entry for entry in root.iterdir() if TMP_DIR.fullmatch(entry.name)]
    kept = [step for step in complete_steps(root) if step <= current][-keep_last:]
    if keep_last > 0 and kept:
        for entry in root.iterdir():
            match = STEP_DIR.fullmatch(entry.name)
            if match and int(match.group(1)) < kept[0]:
                doomed.append(entry)
    for entry in doomed:
        try:
            shutil.rmtree(entry)
        except OSError as err:  # a full cleanup is not worth stopping training for
            logger.warning("could not remove %s: %s", entry, err)


def _read_latest(root: Path) -> int | None:
    try:
        return int((root / LATEST).read_text().strip())
    except (OSError, ValueError):
        return None


def _write_durably(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``, fsynced."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
