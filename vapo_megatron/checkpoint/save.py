"""Saving a training checkpoint, synchronously or in the background: every rank writes its
share into a temporary directory, and rank 0 publishes it once all are done
(``directory.publish``). What a checkpoint holds is described in ``checkpoint/__init__.py``."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from vapo_megatron.checkpoint.directory import (
    EXTRA,
    FORMAT,
    FORMAT_VERSION,
    META,
    OPTIMIZER,
    RANK_EXTRA,
    SCHEDULER,
    WEIGHTS,
    publish,
    rank_file,
    step_dir_name,
)
from vapo_megatron.checkpoint.files import dist_save, save_object
from vapo_megatron.checkpoint.model import METADATA_NAME, CheckpointMetadata
from vapo_megatron.checkpoint.rng import rng_state
from vapo_megatron.checkpoint.state import TrainableState, optimizer_format, sharded_state
from vapo_megatron.parallel import collectives


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
        rank_extra: dict[str, Any] | None = None,
    ) -> None:
        """Save every model's weights, optimizer and scheduler, this rank's RNG and rank 0's
        ``extra`` as checkpoint ``step`` (and each rank's own ``rank_extra``, where given:
        ``load_train_checkpoint`` returns it as ``extra["rank_extra"]`` at the same world
        size).

        Collective over the default process group (megatron's writer) and ``group`` (default:
        every rank; the host group in the trainer) for the barriers. All ranks write into a
        temporary directory, each model's DP x CP ranks sharing its writes; once all are done,
        rank 0 renames it into place and moves ``latest``. Then, with ``keep_last`` > 0, only
        the newest ``keep_last`` complete checkpoints stay (0 keeps all)."""
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0 (0 keeps every checkpoint), got {keep_last}")
        self.finish()
        root = Path(root)
        rank = dist.get_rank(group)
        tmp = _make_tmp_dir(root, step, models, group)
        save_object(rng_state(), tmp / "rng" / rank_file(rank))
        if rank_extra is not None:
            save_object(rank_extra, tmp / RANK_EXTRA / rank_file(rank))
        requests = []
        for name, state in models.items():
            requests += self._write_model(state, tmp / name, step, rank == 0)
        if rank == 0:
            save_object(extra, tmp / EXTRA)
            _write_meta(tmp, step, dist.get_world_size(group), models)
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
        self._queue.schedule_async_request(one_request(requests, publish_on_rank0))
        self.pending = step

    def _write_model(
        self, state: TrainableState, directory: Path, step: int, on_rank0: bool
    ) -> list[Any]:
        """Write (or, in the background, stage) one model's weights and optimizer into
        ``directory``, and on rank 0 its scheduler and weights metadata; return the background
        requests (None entries when synchronous)."""
        model_sd, optimizer_sd = sharded_state(state, is_loading=False)
        requests = [
            dist_save(sharded, directory / part, state.dp_cp_group, asynchronous=self.asynchronous)
            for sharded, part in ((model_sd, WEIGHTS), (optimizer_sd, OPTIMIZER))
        ]
        if on_rank0:
            scheduler = None if state.scheduler is None else state.scheduler.state_dict()
            save_object(scheduler, directory / SCHEDULER)
            if state.weights_meta is not None:
                write_weights_meta(state.weights_meta, directory / WEIGHTS, step)
        return requests

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


def _make_tmp_dir(
    root: Path, step: int, models: Mapping[str, TrainableState], group: dist.ProcessGroup | None
) -> Path:
    """The save's temporary directory, named with a token rank 0 draws, with each model's
    ``weights/`` and ``optimizer/`` made by rank 0 before any rank writes. Collective."""
    token = collectives.broadcast_object(secrets.token_hex(4), group)
    tmp = root / f"{step_dir_name(step)}.tmp-{token}"
    if dist.get_rank(group) == 0:
        for name in models:
            (tmp / name / WEIGHTS).mkdir(parents=True)
            (tmp / name / OPTIMIZER).mkdir()
    collectives.barrier(group)
    return tmp


def _write_meta(
    tmp: Path, step: int, world_size: int, models: Mapping[str, TrainableState]
) -> None:
    """``meta.json``: the format, the step, the world size and each model's layout and
    optimizer format (what a load checks before it reads anything)."""
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "models": {
            name: {
                "layout": state.layout,
                "optimizer_format": optimizer_format(state),
                "weights": state.weights_meta is not None,
            }
            for name, state in models.items()
        },
    }
    (tmp / META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def one_request(requests: list[Any], publish_fn: Any) -> Any:
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


def write_weights_meta(meta: CheckpointMetadata, directory: Path, step: int) -> None:
    """``vapo_checkpoint.json`` next to the weights: ``tools/convert.py mcore-to-hf`` exports
    them (the same keys ``checkpoint/model.py::save_model_weights`` writes)."""
    meta = dataclasses.replace(meta, origin={**meta.origin, "train_step": step})
    text = json.dumps(dataclasses.asdict(meta), indent=2, sort_keys=True) + "\n"
    (directory / METADATA_NAME).write_text(text)
