"""One gradient step of one model on one mini-batch of the step's samples.

The model's data-parallel rank packs its share; the loss normalisers (response tokens,
sequences, tokens of correct responses) are counted over all its micro-batches and reduced
over the model's data x context group *before* the backward pass, so the update equals the
single-device update of the whole mini-batch for any split (``parallel/reductions.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from vapo_megatron.data.packing import MicroBatch, Sample
from vapo_megatron.parallel.collectives import all_gather_objects
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.parallel.reductions import LossNormalisers, global_loss_normalisers
from vapo_megatron.trainer.batching import dp_share, micro_batches
from vapo_megatron.trainer.model_engine import LossFn, ModelEngine


def train_on(
    engine: ModelEngine,
    samples: Sequence[Sample],
    loss_fn_factory: Callable[[LossNormalisers], LossFn],
    *,
    field_names: Sequence[str],
    token_budget: int,
) -> dict[str, float]:
    """Forward, backward and one optimizer step on ``samples`` (the whole mini-batch, the same
    list on every rank). Returns the mini-batch's metrics (global means) on every rank."""
    counts = [len(s.prompt) + len(s.response) for s in samples]
    mine = [samples[i] for i in dp_share(counts, engine.dp_size, engine.dp_rank)]
    return train_on_share(
        engine, mine, loss_fn_factory, field_names=field_names, token_budget=token_budget
    )


def train_on_share(
    engine: ModelEngine,
    mine: Sequence[Sample],
    loss_fn_factory: Callable[[LossNormalisers], LossFn],
    *,
    field_names: Sequence[str],
    token_budget: int,
) -> dict[str, float]:
    """As :func:`train_on`, given only this data-parallel rank's share ``mine`` of the
    mini-batch (``dp_share`` of the mini-batch's token counts): the other ranks' samples are
    never built here."""
    mbs = micro_batches(
        mine, engine.layout, cp_rank=engine.cp_rank, token_budget=token_budget,
        field_names=field_names,
    )  # fmt: skip
    return train_on_micro_batches(engine, mbs, len(mine), loss_fn_factory)


def train_on_micro_batches(
    engine: ModelEngine,
    mbs: Sequence[MicroBatch],
    num_samples: int,
    loss_fn_factory: Callable[[LossNormalisers], LossFn],
    *,
    field_names: Sequence[str] | None = None,
) -> dict[str, float]:
    """As :func:`train_on_share`, on this rank's share already packed (``num_samples``
    samples in ``mbs``): e.g. once for the critic and the policy where both take the same
    samples on one layout. ``field_names``: the fields this model's loss reads (the others
    stay behind, never copied to its device); None keeps every field."""
    if field_names is not None:
        mbs = [mb.with_fields(field_names) for mb in mbs]
    positive = [mb.fields.get("positive", torch.zeros_like(mb.response_mask)) for mb in mbs]
    # Counted on the host where packing left the masks; reduced and used on the model's device.
    norm = global_loss_normalisers(
        [mb.response_mask for mb in mbs], positive, num_samples,
        dp_cp_group=engine.groups.parallel.dp_cp, cp_size=engine.layout.cp, device=engine.device,
    )  # fmt: skip
    outputs = engine.run(mbs, loss_fn_factory(norm))
    metrics = engine.step()
    metrics.update(sum_shares(engine, outputs))
    metrics["num_tokens"] = float(norm.num_tokens)
    return metrics


def sum_shares(engine: ModelEngine, outputs: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Sum metric shares over micro-batches and ranks: each is a share of a global mean, so the
    sum is that mean. Only the last stage's first TP rank of each (data, context) rank counts.
    The scalars come to the host in one copy and travel over the host group (a few floats)."""
    local: dict[str, float] = {}
    if engine.is_last_stage and engine.tp_rank == 0:
        names = [name for out in outputs for name, value in out.items() if value.dim() == 0]
        scalars = [value for out in outputs for value in out.values() if value.dim() == 0]
        values = torch.stack(scalars).to(HOST, torch.float64).tolist() if scalars else []
        for name, value in zip(names, values, strict=True):
            local[name] = local.get(name, 0.0) + value
    total: dict[str, float] = {}
    for part in all_gather_objects(local, engine.groups.host):
        for name, value in part.items():
            total[name] = total.get(name, 0.0) + value
    return total
