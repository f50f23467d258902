"""Reading and writing a training checkpoint's files: megatron's ``dist_checkpointing`` for
sharded state (each replica written once over the model's DP x CP ranks), ``torch.save`` with
fsync for the small per-rank and rank-0 objects."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vapo_megatron.checkpoint.model import in_process_write_results
from vapo_megatron.parallel import collectives


def dist_save(
    sharded: dict[str, Any],
    directory: Path,
    dp_cp_group: dist.ProcessGroup | None,
    *,
    asynchronous: bool,
) -> Any:
    """``dist_checkpointing.save`` into the (empty) ``directory``, each replicated shard written
    once, by one of the model's DP x CP ranks chosen to balance the bytes. Asynchronous: the
    ``AsyncRequest`` that writes it (see ``save.one_request``); else None, written."""
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


def dist_load(
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


def save_object(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def load_object(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False)  # our own pickles
