"""Training checkpoints: what a run needs to continue exactly where it stopped, written atomically.

On disk, under the run's checkpoint root::

    latest                          the step of the newest complete checkpoint ("12\\n")
    step_00000012/                  one complete checkpoint
        COMPLETE                    written last, before the rename; without it nothing loads
        meta.json                   format, step, world size, each model's layout
        extra.pt                    the trainer's state (rank 0's; identical on every rank)
        rng/rank_00000.pt           per rank: python, numpy, torch CPU (and CUDA), Megatron's tracker
        policy/rank_00000.pt        per rank: model chunks, optimizer, scheduler
        policy/weights/             reshardable weights (models/checkpoint.py), when the model
                                    has weights metadata: `tools/convert.py mcore-to-hf` exports it
        critic/...
    step_00000014.tmp-3f9a2c1b/     a save in progress, or killed: never loaded, removed by the
                                    next successful save

Resume state is per-rank ``torch.save``, so it loads back bit for bit but only at the layout
and world size it was saved at; the ``weights/`` directories are the way to another layout.

The optimizer is saved as each (sub-)optimizer's inner torch optimizer ``state_dict`` plus the
parameters it steps (the fp32 main copies in bf16 mode, this rank's shard with the distributed
optimizer), the same for every megatron-core optimizer class. Not megatron's own
``optimizer.state_dict()``: the distributed optimizer's leaves the parameter state out, and its
``load_state_dict`` gives every parameter one shared ``step`` tensor, which torch's Adam then
increments once per parameter (wrong bias correction after a resume).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import re
import secrets
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer
from megatron.core.utils import unwrap_model

from vapo_megatron.models.checkpoint import CheckpointMetadata, save_sharded_state
from vapo_megatron.parallel import collectives

if TYPE_CHECKING:
    from vapo_megatron.trainer.model_engine import ModelEngine

logger = logging.getLogger(__name__)

FORMAT = "vapo-megatron-train-checkpoint"
FORMAT_VERSION = 1
MARKER = "COMPLETE"
LATEST = "latest"
META = "meta.json"
EXTRA = "extra.pt"
WEIGHTS = "weights"
_STEP_DIR = re.compile(r"step_(\d{8})")
_TMP_DIR = re.compile(r"step_\d{8}\.tmp-.+")


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass(kw_only=True)
class TrainableState:
    """One trained model's part of a checkpoint, on this rank."""

    chunks: Sequence[torch.nn.Module]
    """This rank's DDP-wrapped model chunks."""
    optimizer: MegatronOptimizer
    """Its megatron-core optimizer (``get_megatron_optimizer``)."""
    scheduler: Stateful | None = None
    """Learning-rate / weight-decay scheduler (``OptimizerParamScheduler``); None: none."""
    layout: dict[str, Any]
    """JSON-able description of how the model is split (tp, pp, cp, dp, dtype...): saved, and
    compared on load, where any difference is refused."""
    weights_meta: CheckpointMetadata | None = None
    """When set, the weights are also written in the reshardable format with this metadata
    (collective over the default process group)."""
    dp_cp_group: dist.ProcessGroup | None = None
    """The model's data x context parallel group, which decides who writes which replica of
    the reshardable weights; None: megatron-core's ``parallel_state`` one."""

    @classmethod
    def from_engine(
        cls, engine: ModelEngine, *, weights_meta: CheckpointMetadata | None = None
    ) -> TrainableState:
        """The state of a ``ModelEngine`` (``trainer/model_engine.py``)."""
        layout = dataclasses.asdict(engine.layout)
        layout.update(
            dp=engine.groups.dp_size,
            params_dtype=str(engine.config.params_dtype),
            distributed_optimizer=engine.chunks[0].ddp_config.use_distributed_optimizer,
        )
        return cls(
            chunks=engine.chunks,
            optimizer=engine.optimizer,
            scheduler=engine.scheduler,
            layout=layout,
            weights_meta=weights_meta,
            dp_cp_group=engine.groups.pg_collection.dp_cp,
        )


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# ---- the directory, without torch.distributed (rank 0 runs these) ----


def complete_steps(root: str | os.PathLike) -> list[int]:
    """Steps of the complete checkpoints under ``root``, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = _STEP_DIR.fullmatch(entry.name)
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
    doomed = [entry for entry in root.iterdir() if _TMP_DIR.fullmatch(entry.name)]
    kept = [step for step in complete_steps(root) if step <= current][-keep_last:]
    if keep_last > 0 and kept:
        for entry in root.iterdir():
            match = _STEP_DIR.fullmatch(entry.name)
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


# ---- save and load (collective over ``group``) ----


def save_train_checkpoint(
    root: str | os.PathLike,
    step: int,
    models: Mapping[str, TrainableState],
    extra: dict[str, Any],
    *,
    keep_last: int,
    group: dist.ProcessGroup | None = None,
) -> Path:
    """Save every model's state, this rank's RNG and rank 0's ``extra`` as checkpoint ``step``.

    Collective over ``group`` (default: every rank). All ranks write into a temporary
    directory; once all are done, rank 0 renames it into place and moves ``latest``. Then, with
    ``keep_last`` > 0, only the newest ``keep_last`` complete checkpoints stay (0 keeps all).
    Returns the checkpoint's directory."""
    if keep_last < 0:
        raise ValueError(f"keep_last must be >= 0 (0 keeps every checkpoint), got {keep_last}")
    root = Path(root)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    token = _from_rank0(secrets.token_hex(4), group)
    tmp = root / f"{step_dir_name(step)}.tmp-{token}"
    if rank == 0:
        tmp.mkdir(parents=True)
    collectives.barrier(group)
    own = _rank_file(rank)
    _save(_rng_state(), tmp / "rng" / own)
    for name, state in models.items():
        _save(_model_state(state), tmp / name / own)
        if state.weights_meta is not None:
            _save_weights(state, tmp / name / WEIGHTS, step)
    if rank == 0:
        _save(extra, tmp / EXTRA)
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": step,
            "world_size": world_size,
            "models": {
                name: {"layout": state.layout, "weights": state.weights_meta is not None}
                for name, state in models.items()
            },
        }
        (tmp / META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    collectives.barrier(group)
    if rank == 0:
        publish(tmp, root, step, keep_last=keep_last)
    collectives.barrier(group)
    return root / step_dir_name(step)


def load_train_checkpoint(
    root: str | os.PathLike,
    models: Mapping[str, TrainableState],
    *,
    step: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any] | None:
    """Restore the models, optimizers, schedulers and this rank's RNG from checkpoint ``step``
    (default: :func:`latest_step`); return the saved ``extra``, or None if there is none.

    Collective over ``group``. ValueError for an incomplete ``step``, other models, or another
    layout or world size than the checkpoint's."""
    root = Path(root)
    rank = dist.get_rank(group)
    found: tuple[int | None, str | None] = (None, None)
    if rank == 0:  # one rank reads the directory, so all agree (and warn once)
        if step is None:
            found = (latest_step(root), None)
        elif step in complete_steps(root):
            found = (step, None)
        else:
            found = (None, f"{root / step_dir_name(step)} is not a complete checkpoint")
    chosen, error = _from_rank0(found, group)
    if error is not None:
        raise ValueError(f"{error}; complete checkpoints: steps {complete_steps(root)}")
    if chosen is None:
        return None
    directory = root / step_dir_name(chosen)
    meta = json.loads((directory / META).read_text())
    _check_compatible(meta, models, dist.get_world_size(group), directory)
    own = _rank_file(rank)
    for name, state in models.items():
        _load_model_state(state, _load(directory / name / own))
    _set_rng_state(_load(directory / "rng" / own))
    return _load(directory / EXTRA)


def _check_compatible(
    meta: dict[str, Any], models: Mapping[str, TrainableState], world_size: int, directory: Path
) -> None:
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{directory}: format {meta.get('format')!r} version {meta.get('format_version')!r};"
            f" this code reads {FORMAT!r} version {FORMAT_VERSION}"
        )
    if sorted(meta["models"]) != sorted(models):
        raise ValueError(
            f"{directory} holds models {sorted(meta['models'])}, this run trains "
            f"{sorted(models)}: resume with the same models, or start from exported weights"
        )
    saved = {name: entry["layout"] for name, entry in meta["models"].items()}
    current = json.loads(json.dumps({name: state.layout for name, state in models.items()}))
    if meta["world_size"] != world_size or saved != current:
        with_weights = [name for name, entry in meta["models"].items() if entry["weights"]]
        export = (
            f"export the weights (`tools/convert.py mcore-to-hf --ckpt {directory}/<model>/"
            f"{WEIGHTS}`, models {with_weights}) and start from them instead"
            if with_weights
            else "this checkpoint has no reshardable weights to export (save with weights_meta)"
        )
        raise ValueError(
            f"{directory} was saved with world size {meta['world_size']} and layouts {saved}; "
            f"this run has world size {world_size} and layouts {current}. Resume state loads "
            f"only at the same layout and world size: {export}"
        )


def _save_weights(state: TrainableState, directory: Path, step: int) -> None:
    """``models/checkpoint.py``'s format (what ``save_model_weights`` writes), with replica ids
    from the model's own data x context group: with per-model groups, ``parallel_state``'s
    may belong to the other model's layout."""
    meta = state.weights_meta
    meta = dataclasses.replace(meta, origin={**meta.origin, "train_step": step})
    metadata = None if state.dp_cp_group is None else {"dp_cp_group": state.dp_cp_group}
    sharded = {
        f"model{i}": unwrap_model(chunk).sharded_state_dict(metadata=metadata)
        for i, chunk in enumerate(state.chunks)
    }
    save_sharded_state(sharded, directory, meta)


def _from_rank0(value: Any, group: dist.ProcessGroup | None) -> Any:
    return collectives.broadcast_object(value, group)


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False)  # our own pickles


def _cpu_copy(tree: Any) -> Any:
    """``tree`` with every tensor copied to the CPU (a view would save its whole buffer)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {key: _cpu_copy(value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_cpu_copy(value) for value in tree)
    return tree


def _sub_optimizers(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    if isinstance(optimizer, ChainedOptimizer):
        return list(optimizer.chained_optimizers)
    return [optimizer]


def _stepped_params(optimizer: MegatronOptimizer) -> list[torch.Tensor]:
    """The tensors the inner torch optimizer updates: fp32 main params or their shards."""
    return [p for group in optimizer.optimizer.param_groups for p in group["params"]]


def _model_state(state: TrainableState) -> dict[str, Any]:
    return {
        "chunks": [_cpu_copy(chunk.state_dict()) for chunk in state.chunks],
        "optimizers": [
            {
                "torch_optimizer": _cpu_copy(opt.optimizer.state_dict()),
                "main_params": _cpu_copy(_stepped_params(opt)),
            }
            for opt in _sub_optimizers(state.optimizer)
        ],
        "scheduler": None if state.scheduler is None else state.scheduler.state_dict(),
    }


def _load_model_state(state: TrainableState, saved: dict[str, Any]) -> None:
    # Model weights first, main params after: bf16 weights are a rounding of the fp32 main
    # params, and megatron's reload_model_params() would copy the wrong way.
    for chunk, chunk_state in zip(state.chunks, saved["chunks"], strict=True):
        chunk.load_state_dict(chunk_state, strict=True)
    for opt, opt_state in zip(_sub_optimizers(state.optimizer), saved["optimizers"], strict=True):
        with torch.no_grad():
            for param, value in zip(_stepped_params(opt), opt_state["main_params"], strict=True):
                param.copy_(value)
        opt.optimizer.load_state_dict(opt_state["torch_optimizer"])
    if (state.scheduler is None) != (saved["scheduler"] is None):
        raise ValueError(
            "the checkpoint has a scheduler state but this model has no scheduler, or the "
            "other way round: configure the scheduler as in the saved run"
        )
    if state.scheduler is not None:
        state.scheduler.load_state_dict(saved["scheduler"])


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.random.get_cuda_rng_tracker()
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "megatron_tracker": _cpu_copy(tracker.get_states()),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["cuda"])
    tensor_parallel.random.get_cuda_rng_tracker().set_states(state["megatron_tracker"])
