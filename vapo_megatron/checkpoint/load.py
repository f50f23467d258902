"""Loading a training checkpoint: the step to load, the checks that it fits this run (format,
models, the layout its optimizer format can take), then each model's weights, optimizer and
scheduler, and (at the same layout) this rank's RNG."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from megatron.core.utils import unwrap_model

from vapo_megatron.checkpoint.directory import (
    EXTRA,
    FORMAT,
    FORMAT_VERSION,
    META,
    OLD_FORMAT_COMMIT,
    OPTIMIZER,
    RANK_EXTRA,
    SCHEDULER,
    WEIGHTS,
    complete_steps,
    latest_step,
    rank_file,
    step_dir_name,
)
from vapo_megatron.checkpoint.files import dist_load, load_object
from vapo_megatron.checkpoint.model import METADATA_NAME, check_compatible, load_metadata
from vapo_megatron.checkpoint.optimizer_state import load_optimizer, sub_optimizers
from vapo_megatron.checkpoint.rng import set_rng_state
from vapo_megatron.checkpoint.state import TrainableState, sharded_state
from vapo_megatron.parallel import collectives

logger = logging.getLogger(__name__)


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
    chosen, error = collectives.broadcast_object(found, group)
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
    extra = load_object(directory / EXTRA)
    mine = directory / RANK_EXTRA / rank_file(dist.get_rank(group))
    if meta["world_size"] == world_size and mine.is_file():
        extra["rank_extra"] = load_object(mine)
    if meta["world_size"] == world_size and saved == layouts:
        set_rng_state(load_object(directory / "rng" / rank_file(dist.get_rank(group))))
    elif dist.get_rank(group) == 0:
        logger.warning(
            "%s was saved by %d ranks with layouts %s, this run has %d ranks and %s: RNG states "
            "not restored (each rank keeps its seeded state; training draws its randomness "
            "from per-step seeds)",
            directory, meta["world_size"], saved, world_size, layouts,
        )  # fmt: skip
    return extra


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
        _check_same_model(name, state, directory)
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


def _check_same_model(name: str, state: TrainableState, directory: Path) -> None:
    """The saved weights are of the model this run builds (the critic's may be its own,
    critic.model): ValueError naming what differs, before megatron meets other shapes."""
    weights = directory / name / WEIGHTS
    if state.weights_meta is None or not (weights / METADATA_NAME).is_file():
        return
    try:
        check_compatible(
            load_metadata(weights), state.weights_meta.model_config(), state.weights_meta.head
        )
    except ValueError as err:
        raise ValueError(
            f"{weights}: {err}. Resume with the {name}'s model the run was saved with "
            "(model.path; critic.model for the critic), or start a new run from exported weights"
        ) from err


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


def _load_model(state: TrainableState, directory: Path, fmt: str) -> None:
    model_sd, optimizer_sd = sharded_state(state, is_loading=True, optimizer_fmt=fmt)
    # Model weights first, main params after: bf16 weights are a rounding of the fp32 main
    # params, and megatron's reload_model_params() would copy the wrong way.
    loaded = dist_load(model_sd, directory / WEIGHTS, state.dp_cp_group)
    for i, chunk in enumerate(state.chunks):
        unwrap_model(chunk).load_state_dict(loaded[f"model{i}"], strict=True)
    loaded = dist_load(optimizer_sd, directory / OPTIMIZER, state.dp_cp_group)
    subs = sub_optimizers(state.optimizer)
    if len(subs) > 1:  # ChainedOptimizer's sharded state: one entry per sub-optimizer
        parts = [loaded[key] for key in sorted(loaded)]
    else:
        parts = [loaded]
    for opt, part in zip(subs, parts, strict=True):
        load_optimizer(opt, part)
    scheduler = load_object(directory / SCHEDULER)
    if (state.scheduler is None) != (scheduler is None):
        raise ValueError(
            "the checkpoint has a scheduler state but this model has no scheduler, or the "
            "other way round: configure the scheduler as in the saved run"
        )
    if state.scheduler is not None:
        state.scheduler.load_state_dict(scheduler)
