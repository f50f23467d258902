"""Training checkpoints: what a run needs to continue where it stopped, written atomically.

On disk, under the run's checkpoint root::

    latest                          the step of the newest complete checkpoint ("12\\n")
    step_00000012/                  one complete checkpoint
        COMPLETE                    written last, before the rename; without it nothing loads
        meta.json                   format, step, world size, each model's layout and optimizer
                                    format
        extra.pt                    the trainer's state (rank 0's; identical on every rank)
        rng/rank_00000.pt           per rank: python, numpy, torch CPU (and CUDA), Megatron's tracker
        policy/weights/             megatron dist_checkpointing (torch_dist): the model's
                                    ``sharded_state_dict``; with weights metadata also
                                    ``vapo_checkpoint.json``, and `tools/convert.py mcore-to-hf`
                                    exports it
        policy/optimizer/           dist_checkpointing: the optimizer's ``sharded_state_dict``
        policy/scheduler.pt         the learning-rate schedule's position (rank 0's)
        critic/...
    step_00000014.tmp-3f9a2c1b/     a save in progress, or killed: never loaded, removed by the
                                    next successful save

Each tensor is written once: replicas (data- and context-parallel copies of a weight, the plain
optimizer's state) are split between the model's DP x CP ranks by megatron's fully parallel
strategy, so a checkpoint has the same bytes at any DP size. Loading reshards: another DP or
CP size always; another TP/PP with the plain optimizer (its state is per parameter) or with a
distributed optimizer saved ``fully_reshardable`` (``TrainableState.fully_reshardable``; the
save gathers each DP group's state, so it costs host memory); the distributed optimizer's
default ``dp_reshardable`` format stores its own buckets and loads at another DP/CP only. At
the same layout a resume is bit for bit.
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
from megatron.core.optimizer import ChainedOptimizer, DistributedOptimizer, MegatronOptimizer
from megatron.core.utils import unwrap_model

from vapo_megatron.models.checkpoint import METADATA_NAME, CheckpointMetadata
from vapo_megatron.models.checkpoint import _in_process_write_results as in_process_write_results
from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.devices import HOST

if TYPE_CHECKING:
    from vapo_megatron.trainer.model_engine import ModelEngine

logger = logging.getLogger(__name__)

FORMAT = "vapo-megatron-train-checkpoint"
FORMAT_VERSION = 2
OLD_FORMAT_COMMIT = "0427728"
"""The last commit that writes (and reads) format_version 1, the per-rank pickles."""
MARKER = "COMPLETE"
LATEST = "latest"
META = "meta.json"
EXTRA = "extra.pt"
WEIGHTS = "weights"
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler.pt"
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
    """When set, ``weights/`` also gets this metadata (``vapo_checkpoint.json``), which makes it
    a model checkpoint that ``tools/convert.py mcore-to-hf`` exports."""
    dp_cp_group: dist.ProcessGroup | None = None
    """The model's data x context parallel group, over which replicas are split between
    writers and readers; None: megatron-core's ``parallel_state`` one."""
    fully_reshardable: bool = False
    """Distributed optimizer only: save its state in the ``fully_reshardable`` format (loads
    at another TP/PP; the save gathers the state of each DP group) instead of
    ``dp_reshardable`` (loads at another DP/CP only)."""

    @classmethod
    def from_engine(
        cls,
        engine: ModelEngine,
        *,
        weights_meta: CheckpointMetadata | None = None,
        fully_reshardable: bool = False,
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
            fully_reshardable=fully_reshardable,
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
    """Save checkpoint ``step`` synchronously (see :meth:`CheckpointSaver.save`); return its
    directory."""
    CheckpointSaver().save(root, step, models, extra, keep_last=keep_last, group=group)
    return Path(root) / step_dir_name(step)


class CheckpointSaver:
    """Writes training checkpoints, synchronously or in the background.

    In the background (``asynchronous``), :meth:`save` returns once every tensor has been
    staged on the host (megatron's ``preload``: device-to-host copies) and a forked process
    writes the files; the checkpoint is published (marker, rename, ``latest``) only after every
    rank's writer has finished, by :meth:`poll` or :meth:`finish`, so a run killed while writing
    resumes from the previous checkpoint. One save at a time: :meth:`save` first finishes the
    pending one. Every method is collective (default process group and ``group``)."""

    def __init__(self, *, asynchronous: bool = False) -> None:
        self.asynchronous = asynchronous
        self.pending: int | None = None
        """The step being written in the background; None: nothing pending."""
        self._queue: Any = None  # megatron's AsyncCallsQueue, made on the first async save

    def save(
        self,
        root: str | os.PathLike,
        step: int,
        models: Mapping[str, TrainableState],
        extra: dict[str, Any],
        *,
        keep_last: int,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """Save every model's weights, optimizer and scheduler, this rank's RNG and rank 0's
        ``extra`` as checkpoint ``step``.

        Collective over the default process group (megatron's writer) and ``group`` (default:
        every rank; the host group in the trainer) for the barriers. All ranks write into a
        temporary directory, each model's DP x CP ranks sharing its writes; once all are done,
        rank 0 renames it into place and moves ``latest``. Then, with ``keep_last`` > 0, only
        the newest ``keep_last`` complete checkpoints stay (0 keeps all)."""
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0 (0 keeps every checkpoint), got {keep_last}")
        self.finish()
        root = Path(root)
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        token = _from_rank0(secrets.token_hex(4), group)
        tmp = root / f"{step_dir_name(step)}.tmp-{token}"
        if rank == 0:
            for name in models:
                (tmp / name / WEIGHTS).mkdir(parents=True)
                (tmp / name / OPTIMIZER).mkdir()
        collectives.barrier(group)
        _save(_rng_state(), tmp / "rng" / _rank_file(rank))
        requests = []
        for name, state in models.items():
            for opt in sub_optimizers(state.optimizer):  # e.g. a policy frozen so far
                fill_fresh_optimizer_state(opt)
            model_sd = _model_sharded_state(state)
            # Built before the model's save, which applies its factories in place: the
            # optimizer finds its parameters in the model's sharded state by tensor identity.
            optimizer_sd = state.optimizer.sharded_state_dict(
                model_sd, is_loading=False, metadata=_optimizer_metadata(state)
            )
            for sharded, part in ((model_sd, WEIGHTS), (optimizer_sd, OPTIMIZER)):
                request = _dist_save(
                    sharded, tmp / name / part, state.dp_cp_group, asynchronous=self.asynchronous
                )
                requests.append(request)
            if rank == 0:
                scheduler = None if state.scheduler is None else state.scheduler.state_dict()
                _save(scheduler, tmp / name / SCHEDULER)
                if state.weights_meta is not None:
                    _write_weights_meta(state.weights_meta, tmp / name / WEIGHTS, step)
        if rank == 0:
            _save(extra, tmp / EXTRA)
            meta = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "step": step,
                "world_size": world_size,
                "models": {
                    name: {
                        "layout": state.layout,
                        "optimizer_format": _optimizer_format(state),
                        "weights": state.weights_meta is not None,
                    }
                    for name, state in models.items()
                },
            }
            (tmp / META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        collectives.barrier(group)

        def publish_on_rank0() -> None:
            if rank == 0:
                publish(tmp, root, step, keep_last=keep_last)

        if not self.asynchronous:
            publish_on_rank0()
            collectives.barrier(group)
            return
        if self._queue is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._queue = AsyncCallsQueue(persistent=False)
        self._queue.schedule_async_request(_one_request(requests, publish_on_rank0))
        self.pending = step

    def poll(self) -> int | None:
        """Publish the pending checkpoint if every rank has written its part; return its step,
        or None (nothing pending, or still writing). Collective: call it on every rank."""
        if self.pending is None:
            return None
        self._queue.maybe_finalize_async_calls(blocking=False)
        return self._published()

    def finish(self) -> int | None:
        """Wait for the pending checkpoint and publish it; return its step (None: nothing was
        pending). Collective."""
        if self.pending is None:
            return None
        self._queue.maybe_finalize_async_calls(blocking=True)
        return self._published()

    def _published(self) -> int | None:
        if self._queue.get_num_unfinalized_calls():
            return None
        step, self.pending = self.pending, None
        return step


def _one_request(requests: list[Any], publish_fn: Any) -> Any:
    """The model and optimizer saves of one checkpoint as one background job: their staging
    (device-to-host copies) now, their writes one after the other in one forked process, then
    their finalisations (megatron's metadata, in save order) and the publication."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    calls = []
    for request in requests:
        if request.async_fn is None:  # nothing to write on this rank
            continue
        args = list(request.async_fn_args)
        if request.preload_fn is not None:
            args[1] = request.preload_fn()
        calls.append((request.async_fn, args, request.async_fn_kwargs))
    finalize = [fn for request in requests for fn in request.finalize_fns] + [publish_fn]
    return AsyncRequest(_run_calls, (calls,), finalize)


def _run_calls(calls: list[tuple[Any, list[Any], dict[str, Any]]]) -> None:
    for fn, args, kwargs in calls:
        fn(*args, **kwargs)


def load_train_checkpoint(
    root: str | os.PathLike,
    models: Mapping[str, TrainableState],
    *,
    step: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any] | None:
    """Restore the models, optimizers, schedulers and (at the same world size and layouts) this
    rank's RNG from checkpoint ``step`` (default: :func:`latest_step`); return the saved ``extra``, or None
    if there is none.

    Collective over the default process group and ``group``. Another DP or CP size loads
    (dist_checkpointing reshards); another TP/PP loads with the plain optimizer or a
    distributed one saved ``fully_reshardable``. ValueError for an incomplete ``step``, other
    models, a layout the saved format cannot take, or a checkpoint of the old per-rank format."""
    root = Path(root)
    found: tuple[int | None, str | None] = (None, None)
    if dist.get_rank(group) == 0:  # one rank reads the directory, so all agree (and warn once)
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
    _check_compatible(meta, models, directory)
    for name, state in models.items():
        _load_model(state, directory / name, meta["models"][name]["optimizer_format"])
    # A rank's RNG states (Megatron's tracker is seeded per TP/PP rank) belong to its place
    # in the layout: restored only where every rank has the same one.
    world_size = dist.get_world_size(group)
    layouts = json.loads(json.dumps({name: state.layout for name, state in models.items()}))
    saved = {name: entry["layout"] for name, entry in meta["models"].items()}
    if meta["world_size"] == world_size and saved == layouts:
        _set_rng_state(_load(directory / "rng" / _rank_file(dist.get_rank(group))))
    elif dist.get_rank(group) == 0:
        logger.warning(
            "%s was saved by %d ranks with layouts %s, this run has %d ranks and %s: RNG states "
            "not restored (each rank keeps its seeded state; training draws its randomness "
            "from per-step seeds)",
            directory, meta["world_size"], saved, world_size, layouts,
        )  # fmt: skip
    return _load(directory / EXTRA)


def _check_compatible(
    meta: dict[str, Any], models: Mapping[str, TrainableState], directory: Path
) -> None:
    if meta.get("format") == FORMAT and meta.get("format_version") == 1:
        raise ValueError(_old_format_message(meta, directory))
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
    for name, state in models.items():
        saved = meta["models"][name]
        fmt = saved["optimizer_format"]
        current = json.loads(json.dumps(state.layout))
        fixed = ["params_dtype", "distributed_optimizer"]
        if fmt == "dp_reshardable":
            fixed += ["tp", "pp", "vpp"]
        differ = {
            key: (saved["layout"].get(key), current.get(key))
            for key in fixed
            if saved["layout"].get(key) != current.get(key)
        }
        if differ:
            hint = (
                "resave it at its own layout with trainer.checkpoint_fully_reshardable=true "
                "(resume there, then save), or export the weights and start from them"
                if fmt == "dp_reshardable"
                and not {"params_dtype", "distributed_optimizer"} & set(differ)
                else "resume with the saved setting, or export the weights and start from them"
            )
            raise ValueError(
                f"{directory}: {name} was saved with {{{_pairs(differ, 0)}}} and optimizer format "
                f"{fmt!r}; this run has {{{_pairs(differ, 1)}}}, which that format cannot load: "
                f"{hint}"
            )


def _pairs(differ: dict[str, tuple[Any, Any]], which: int) -> str:
    return ", ".join(f"{key!r}: {values[which]!r}" for key, values in differ.items())


def _old_format_message(meta: dict[str, Any], directory: Path) -> str:
    with_weights = [name for name, entry in meta["models"].items() if entry.get("weights")]
    if "policy" in with_weights:
        way = (
            f"export its policy with `python tools/convert.py mcore-to-hf --ckpt "
            f"{directory}/policy/{WEIGHTS} --out HF_DIR` and start a new run from it "
            "(`vapo-train RECIPE model.path=HF_DIR trainer.run_dir=NEW_DIR`)"
        )
    else:
        way = (
            "it has no exportable weights; continue it with the version that wrote it "
            f"(`git checkout {OLD_FORMAT_COMMIT}`, then the same `vapo-train` command), or "
            "let that version export the policy (trainer.export_hf=true) and start a new run "
            "from it (`vapo-train RECIPE model.path=RUN_DIR/hf_policy trainer.run_dir=NEW_DIR`)"
        )
    return (
        f"{directory} is a checkpoint of the old per-rank format (format_version 1: "
        f"torch.save per rank, world size {meta.get('world_size')}), which this version no "
        f"longer reads: {way}"
    )


def _optimizer_format(state: TrainableState) -> str:
    """How the optimizer's state is laid out on disk: ``model_space`` (plain optimizer: one
    tensor per parameter, reshardable anywhere), or the distributed optimizer's
    ``dp_reshardable`` (its own buckets: another DP/CP only) / ``fully_reshardable``."""
    if not state.layout.get("distributed_optimizer"):
        return "model_space"
    return "fully_reshardable" if state.fully_reshardable else "dp_reshardable"


def _optimizer_metadata(state: TrainableState, fmt: str | None = None) -> dict[str, Any]:
    # Without a sharding type megatron 0.16 picks fully_sharded_model_space, whose
    # flattened_range tensors its own save path rejects.
    metadata: dict[str, Any] = {"distrib_optim_sharding_type": fmt or _optimizer_format(state)}
    if state.dp_cp_group is not None:
        metadata["dp_cp_group"] = state.dp_cp_group
    return metadata


def _model_sharded_state(state: TrainableState) -> dict[str, Any]:
    """Each chunk's ``sharded_state_dict`` under ``model{i}``, replica ids from the model's own
    data x context group: with per-model groups, ``parallel_state``'s may belong to the other
    model's layout (the same keys ``models/checkpoint.py`` writes, so ``weights/`` exports)."""
    metadata = None if state.dp_cp_group is None else {"dp_cp_group": state.dp_cp_group}
    return {
        f"model{i}": unwrap_model(chunk).sharded_state_dict(metadata=metadata)
        for i, chunk in enumerate(state.chunks)
    }


def _dist_save(
    sharded: dict[str, Any],
    directory: Path,
    dp_cp_group: dist.ProcessGroup | None,
    *,
    asynchronous: bool,
) -> Any:
    """``dist_checkpointing.save`` into the (empty) ``directory``, each replicated shard written
    once, by one of the model's DP x CP ranks chosen to balance the bytes. Asynchronous: the
    ``AsyncRequest`` that writes it (see :func:`_one_request`); else None, written."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    strategy = FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy(), dp_cp_group or dist.group.WORLD
    )
    if asynchronous:  # results travel from the forked writer through megatron's queue
        return dist_checkpointing.save(sharded, str(directory), strategy, async_sharded_save=True)
    with in_process_write_results():
        dist_checkpointing.save(sharded, str(directory), strategy)
    return None


def _dist_load(
    sharded: dict[str, Any], directory: Path, dp_cp_group: dist.ProcessGroup | None
) -> dict[str, Any]:
    """``dist_checkpointing.load``; any key the model asks for that the checkpoint lacks, or
    the other way round, raises. On GPU each shard is read once over the model's DP x CP ranks
    and exchanged over that (NCCL) group; megatron-core 0.16's exchange stages on CUDA
    whatever the group's backend, so on gloo every rank reads what it needs itself."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
    )
    from megatron.core.dist_checkpointing.validation import StrictHandling

    strategy = get_default_load_sharded_strategy(str(directory))
    if collectives.group_device(dp_cp_group).type == "cuda":
        strategy = FullyParallelLoadStrategyWrapper(strategy, dp_cp_group or dist.group.WORLD)
    return dist_checkpointing.load(
        sharded, str(directory), strategy, strict=StrictHandling.RAISE_ALL
    )


def _load_model(state: TrainableState, directory: Path, fmt: str) -> None:
    for opt in sub_optimizers(state.optimizer):
        fill_fresh_optimizer_state(opt)
    model_sd = _model_sharded_state(state)
    # is_loading=True: without it the loaded state holds no Adam moments (AReaL #1468). Built
    # before the model's load, for the same tensor-identity reason as in the save.
    optimizer_sd = state.optimizer.sharded_state_dict(
        model_sd, is_loading=True, metadata=_optimizer_metadata(state, fmt)
    )
    # Model weights first, main params after: bf16 weights are a rounding of the fp32 main
    # params, and megatron's reload_model_params() would copy the wrong way.
    loaded = _dist_load(model_sd, directory / WEIGHTS, state.dp_cp_group)
    for i, chunk in enumerate(state.chunks):
        unwrap_model(chunk).load_state_dict(loaded[f"model{i}"], strict=True)
    loaded = _dist_load(optimizer_sd, directory / OPTIMIZER, state.dp_cp_group)
    subs = sub_optimizers(state.optimizer)
    if len(subs) > 1:  # ChainedOptimizer's sharded state: one entry per sub-optimizer
        parts = [loaded[key] for key in sorted(loaded)]
    else:
        parts = [loaded]
    for opt, part in zip(subs, parts, strict=True):
        _load_optimizer(opt, part)
    scheduler = _load(directory / SCHEDULER)
    if (state.scheduler is None) != (scheduler is None):
        raise ValueError(
            "the checkpoint has a scheduler state but this model has no scheduler, or the "
            "other way round: configure the scheduler as in the saved run"
        )
    if state.scheduler is not None:
        state.scheduler.load_state_dict(scheduler)


def _load_optimizer(opt: MegatronOptimizer, loaded: dict[str, Any]) -> None:
    """``opt.load_state_dict(loaded)``, around two megatron-core 0.16 bugs of the distributed
    optimizer with torch's Adam: its ``load_state_dict`` gives every parameter one shared
    ``step`` tensor (torch's Adam then increments it once per parameter: wrong bias correction),
    and its parameter-state loaders copy into every state key, ``step`` included, which the
    fully reshardable format does not hold (KeyError) and the DP-reshardable one holds as this
    rank's stale pre-load value. So: the parameter-free part first, then the parameter state
    with ``step`` set aside, then one ``step`` per parameter."""
    if not isinstance(opt, DistributedOptimizer):
        # FP32Optimizer's state is torch's; the mixed-precision ones nest it under "optimizer".
        inner = loaded["optimizer"]["state"] if "optimizer" in loaded else loaded["state"]
        if _uses_torch_adam(opt) and inner and "common_step" not in inner:
            # megatron saves the common step only when it is nonzero (a state saved before the
            # first update), and torch's Adam refuses moments without a step.
            inner["common_step"] = torch.zeros((), dtype=torch.float32, device=HOST)
        opt.load_state_dict(loaded)  # one deep copy of the common step per parameter
        return
    param_state = loaded.pop("param_state")
    fmt = loaded.pop("param_state_sharding_type")
    opt.load_state_dict(loaded)
    inner = opt.optimizer.state
    steps = {param: entry.pop("step") for param, entry in inner.items() if "step" in entry}
    with torch.no_grad():  # copies into the fp32 main params, which are leaves with grad
        if fmt == "dp_reshardable":
            for entry in _nested_dicts_with(param_state, "padding"):
                entry.pop("step", None)
            opt.load_parameter_state_from_dp_reshardable(param_state)
        elif fmt == "fully_reshardable":
            opt.load_parameter_state_from_fully_reshardable(param_state)
        else:
            raise ValueError(f"unknown distributed optimizer format {fmt!r} in the checkpoint")
    for param, step in steps.items():
        inner[param]["step"] = step.detach().clone()
    if steps:  # torch's Adam counts in its state; megatron's copy in the groups would go stale
        for group in opt.optimizer.param_groups:
            group.pop("step", None)


def fill_fresh_optimizer_state(opt: MegatronOptimizer) -> None:
    """Give every parameter that has no optimizer state yet the state a first step would make:
    megatron's ``init_state_fn`` (Adam's zero moments, or Transformer Engine's own
    ``initialize_state`` with the precision-aware optimizer) and, for torch's Adam, a zero
    per-parameter ``step``.

    An optimizer that has not stepped holds no state: a policy frozen through critic
    pretraining, and any model under TE's ``FusedAdam``, which makes its state lazily at the
    first ``step()``. A save would then write no moments (the distributed optimizer writes only
    ``param``) while every load lays them out and asks for them, so such a checkpoint could not
    be loaded. The zero state is what the first step would have made: training is unchanged.
    TE's and Apex's Adam keep their step count in the parameter groups, not per parameter."""
    if opt.init_state_fn is not None:
        opt.init_state_fn(opt.optimizer, opt.config)
    if not _uses_torch_adam(opt):
        return
    for group in opt.optimizer.param_groups:
        for param in group["params"]:
            state = opt.optimizer.state[param]
            if "step" not in state:  # torch's Adam makes a host float32 zero at its first step
                state["step"] = torch.zeros((), dtype=torch.float32, device=HOST)


def _uses_torch_adam(opt: MegatronOptimizer) -> bool:
    return isinstance(opt.optimizer, torch.optim.Adam | torch.optim.AdamW)


def _nested_dicts_with(tree: Any, key: str) -> list[dict[str, Any]]:
    if isinstance(tree, dict):
        found = [tree] if key in tree else []
        return found + [d for value in tree.values() for d in _nested_dicts_with(value, key)]
    if isinstance(tree, list | tuple):
        return [d for value in tree for d in _nested_dicts_with(value, key)]
    return []


def _write_weights_meta(meta: CheckpointMetadata, directory: Path, step: int) -> None:
    """``vapo_checkpoint.json`` next to the weights: ``tools/convert.py mcore-to-hf`` exports
    them (the same keys ``models/checkpoint.py::save_model_weights`` writes)."""
    meta = dataclasses.replace(meta, origin={**meta.origin, "train_step": step})
    text = json.dumps(dataclasses.asdict(meta), indent=2, sort_keys=True) + "\n"
    (directory / METADATA_NAME).write_text(text)


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


def sub_optimizers(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    """The optimizers a megatron optimizer is made of (a ``ChainedOptimizer``'s, or itself)."""
    if isinstance(optimizer, ChainedOptimizer):
        return list(optimizer.chained_optimizers)
    return [optimizer]


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
