"""One trained model's part of a training checkpoint (:class:`TrainableState`) and its sharded
state dicts as megatron's ``dist_checkpointing`` writes and reads them (:func:`sharded_state`):
the saver, the loader and the dry run's byte count all build them here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.utils import unwrap_model

from vapo_megatron.checkpoint.model import CheckpointMetadata
from vapo_megatron.checkpoint.optimizer_state import fill_fresh_optimizer_state, sub_optimizers


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


def optimizer_format(state: TrainableState) -> str:
    """How the optimizer's state is laid out on disk: ``model_space`` (plain optimizer: one
    tensor per parameter, reshardable anywhere), or the distributed optimizer's
    ``dp_reshardable`` (its own buckets: another DP/CP only) / ``fully_reshardable``."""
    if not state.layout.get("distributed_optimizer"):
        return "model_space"
    return "fully_reshardable" if state.fully_reshardable else "dp_reshardable"


def optimizer_metadata(state: TrainableState, fmt: str | None = None) -> dict[str, Any]:
    # Without a sharding type megatron 0.16 picks fully_sharded_model_space, whose
    # flattened_range tensors its own save path rejects.
    metadata: dict[str, Any] = {"distrib_optim_sharding_type": fmt or optimizer_format(state)}
    if state.dp_cp_group is not None:
        metadata["dp_cp_group"] = state.dp_cp_group
    return metadata


def model_sharded_state(state: TrainableState) -> dict[str, Any]:
    """Each chunk's ``sharded_state_dict`` under ``model{i}``, replica ids from the model's own
    data x context group: with per-model groups, ``parallel_state``'s may belong to the other
    model's layout (the same keys ``checkpoint/model.py`` writes, so ``weights/`` exports)."""
    metadata = None if state.dp_cp_group is None else {"dp_cp_group": state.dp_cp_group}
    return {
        f"model{i}": unwrap_model(chunk).sharded_state_dict(metadata=metadata)
        for i, chunk in enumerate(state.chunks)
    }


def sharded_state(
    state: TrainableState, *, is_loading: bool, optimizer_fmt: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the optimizer's sharded state dicts, as a save writes them or a load
    (``is_loading``) fills them; ``optimizer_fmt``: the saved optimizer format (default: the
    one this state saves). A fresh optimizer first gets the state its first step would make
    (:func:`fill_fresh_optimizer_state`: e.g. a policy frozen so far).

    The optimizer's is built from the model's before the model's save or load applies its
    factories in place: the optimizer finds its parameters in it by tensor identity. Loading
    needs ``is_loading=True``: without it the loaded state holds no Adam moments (AReaL #1468)."""
    for opt in sub_optimizers(state.optimizer):
        fill_fresh_optimizer_state(opt)
    model_sd = model_sharded_state(state)
    optimizer_sd = state.optimizer.sharded_state_dict(
        model_sd, is_loading=is_loading, metadata=optimizer_metadata(state, optimizer_fmt)
    )
    return model_sd, optimizer_sd
