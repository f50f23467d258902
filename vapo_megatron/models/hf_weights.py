"""Move HF-named weights into this rank's model chunks, and gather them back out.

Both go through the model record (``record.py``), the one HF <-> Megatron map. The way out is
what the rollout weight stream and checkpoint export build on: this rank's pipeline stage,
gathered over tensor parallelism, as full HF-named tensors in a fixed order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import unwrap_model

from vapo_megatron.models.record import ModelChunk, ModelRecord, Split


def model_chunks_of_rank(config: TransformerConfig, pp_rank: int) -> list[ModelChunk]:
    """The record's view of each model chunk this pipeline rank builds."""
    vpp = config.virtual_pipeline_model_parallel_size
    if vpp is None:
        return [ModelChunk.for_stage(config, pp_rank)]
    return [ModelChunk.for_stage(config, pp_rank, vp_stage) for vp_stage in range(vpp)]


def load_hf_weights(
    models: list[torch.nn.Module],
    record: ModelRecord,
    hf_tensors: Mapping[str, torch.Tensor],
    config: TransformerConfig,
    *,
    tp_rank: int,
    pp_rank: int,
) -> None:
    """Copy full HF-named tensors into this rank's (possibly wrapped) model chunks.

    Every parameter of every chunk must be covered: a tensor the record does not produce is a
    ValueError, never left at its initial value.
    """
    tp_size = config.tensor_model_parallel_size
    for model, chunk in zip(models, model_chunks_of_rank(config, pp_rank), strict=True):
        shards = record.hf_to_megatron_shards(hf_tensors, tp_rank, tp_size, chunk)
        module = unwrap_model(model)
        params = dict(module.named_parameters())
        if set(params) != set(shards):
            raise ValueError(
                f"record and model disagree on layers {chunk.layers}: model only "
                f"{sorted(set(params) - set(shards))[:5]}, record only "
                f"{sorted(set(shards) - set(params))[:5]}"
            )
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(shards[name])


def gather_hf_weights(
    models: list[torch.nn.Module],
    record: ModelRecord,
    config: TransformerConfig,
    *,
    tp_group: dist.ProcessGroup | None,
    pp_rank: int,
    only_to_tp_rank: int | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """This pipeline rank's weights as full HF-named tensors, gathered over ``tp_group``.

    Yields in the record's order, one Megatron tensor at a time (so at most one full tensor
    plus its shards is alive). Collective: every rank of the TP group must iterate to the end.
    With ``only_to_tp_rank``, shards are gathered to that member of the TP group alone, and
    only it yields tensors (the others yield nothing; their iteration only sends shards).
    """
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
    receives = only_to_tp_rank is None or only_to_tp_rank == tp_rank
    for model, chunk in zip(models, model_chunks_of_rank(config, pp_rank), strict=True):
        params = dict(unwrap_model(model).named_parameters())
        for name, m in record.tensor_maps(chunk).items():
            if m.tied_copy:  # the first stage exports the shared embedding
                continue
            local = params[name].detach()
            if tp_size > 1 and m.split is not Split.REPLICATED:
                shards = [torch.empty_like(local) for _ in range(tp_size)] if receives else None
                if only_to_tp_rank is None:
                    dist.all_gather(shards, local.contiguous(), group=tp_group)
                else:
                    dst = dist.get_global_rank(tp_group, only_to_tp_rank)
                    dist.gather(local.contiguous(), shards, dst=dst, group=tp_group)
            else:
                shards = [local] * tp_size
            if receives:
                yield from record.megatron_to_hf(name, shards, chunk)
