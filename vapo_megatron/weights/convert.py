"""HF <-> megatron-core checkpoint conversion (what ``tools/convert.py`` runs).

:func:`hf_to_mcore` makes a policy or critic checkpoint (``checkpoint/model.py`` format) from
an HF directory; :func:`mcore_to_hf` writes an HF directory from a checkpoint saved at any
TP/PP. Names and TP splits come from the model record, nowhere else. Memory: a rank of
:func:`hf_to_mcore` holds its own shards once (made from lazily read HF tensors into a
meta-device model); :func:`mcore_to_hf` (one process, any saved layout) holds one decoder
layer plus one output shard.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vapo_megatron.checkpoint.model import (
    ASSETS_DIR,
    DTYPE_NAMES,
    CheckpointMetadata,
    CriticFrom,
    check_compatible,
    load_metadata,
    make_metadata,
    save_sharded_state,
)
from vapo_megatron.models.config import Head, HFModelConfig
from vapo_megatron.parallel import collectives
from vapo_megatron.weights import hf_io
from vapo_megatron.weights.mtp import (
    MTP_COPIES,
    MTP_DIR,
    MTP_IN_MODEL,
    MTP_ORIGIN,
    check_mtp_in_model,
    is_mtp_tensor,
    mtp_copies,
    mtp_in_checkpoint,
    mtp_tensors,
    write_mtp,
)
from vapo_megatron.weights.record import ModelChunk, ModelRecord

# ----- HF -> Megatron -----


@dataclass(frozen=True)
class HFSource:
    """An HF checkpoint checked for conversion: every tensor known, present, of the right shape."""

    checkpoint: hf_io.HFCheckpoint
    """The directory, read lazily."""
    hf: HFModelConfig
    """Its architecture."""
    head: Head
    """The head of the Megatron model to make."""
    critic_from: CriticFrom | None
    """None: policy; 'policy': critic with the policy's trunk and a fresh (zero) value head;
    'reward-model': critic with the reward model's trunk and ``score.weight``."""
    dtype: torch.dtype
    """dtype of the Megatron checkpoint."""
    mtp: bool = False
    """The MTP layers go into the model (``policy.mtp.loss_weight`` > 0 trains them), not
    beside it as files (``weights/mtp.py``)."""

    def record(self) -> ModelRecord:
        return ModelRecord(self.hf, self.head, layer_spec="local", mtp=self.mtp)  # as built


def inspect_hf(
    hf_dir: str | os.PathLike,
    *,
    critic_from: CriticFrom | None = None,
    dtype: torch.dtype | None = None,
    mtp: bool = False,
) -> HFSource:
    """Read an HF directory's config and headers and check it can be converted as asked
    (``mtp``: the MTP layers into the model, for a policy trained with
    ``policy.mtp.loss_weight`` > 0).

    ValueError for an unsupported architecture, a missing or unexpected tensor, a wrong shape, a
    non-float tensor, or a head that does not match the checkpoint. Reads no tensor data."""
    checkpoint = hf_io.HFCheckpoint(hf_dir)
    hf = HFModelConfig.from_hf(checkpoint.config)
    names = set(checkpoint.names)
    is_reward_model = "score.weight" in names
    if critic_from is None and is_reward_model:
        raise ValueError(
            f"{hf_dir} is a reward/score model (it has score.weight): convert it as a critic "
            "with --critic-from reward-model"
        )
    if critic_from == "policy" and is_reward_model:
        raise ValueError(
            f"{hf_dir} is a reward/score model, not a policy: use --critic-from reward-model"
        )
    if critic_from == "reward-model" and not is_reward_model:
        raise ValueError(
            f"{hf_dir} has no score.weight, so it is not a reward model; to start the critic "
            "from this policy use --critic-from policy"
        )
    head: Head = "lm" if critic_from is None else "value"
    # A critic from a policy reads the policy's tensors (lm_head, when untied, is not used).
    expect = ModelRecord(hf, "value" if is_reward_model else "lm")
    whole = ModelChunk.whole(hf.num_layers)
    expected = set(expect.hf_names(whole))
    names = {name for name in names if not is_mtp_tensor(hf, name)}  # weights/mtp.py
    missing, unexpected = sorted(expected - names), sorted(names - expected)
    if missing:
        raise ValueError(f"{hf_dir}: {len(missing)} tensor(s) missing: {missing[:8]}")
    if unexpected:
        hint = ""
        if "lm_head.weight" in unexpected and hf.tie_word_embeddings:
            hint = " (config.json says tie_word_embeddings=true, but there is an lm_head.weight)"
        raise ValueError(
            f"{hf_dir}: {len(unexpected)} unexpected tensor(s), not part of a "
            f"{hf.family} model with {hf.num_layers} layers{hint}: {unexpected[:8]}"
        )
    dtypes = set()
    for name, info in checkpoint.tensors.items():
        if is_mtp_tensor(hf, name):
            continue
        want = expect.hf_shape(name)
        if info.shape != want:
            raise ValueError(
                f"{hf_dir}: tensor {name!r} has shape {info.shape}, the config implies {want}"
            )
        if not info.dtype.is_floating_point:
            raise ValueError(f"{hf_dir}: tensor {name!r} has non-float dtype {info.dtype}")
        dtypes.add(info.dtype)
    if dtype is None:
        if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPE_NAMES:
            raise ValueError(
                f"{hf_dir} holds {sorted(map(str, dtypes))} tensors; choose the checkpoint "
                "dtype with --dtype bf16 or --dtype fp32"
            )
        dtype = next(iter(dtypes))
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"checkpoint dtype must be float32 or bfloat16, got {dtype}")
    if mtp:
        check_mtp_in_model(hf, head, hf_dir)
        list(mtp_tensors(hf_dir, hf))  # every MTP layer present (reads headers, no data)
    return HFSource(checkpoint, hf, head, critic_from, dtype, mtp)


def check_layout(hf: HFModelConfig, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
    """ValueError naming the fix when TP/PP (and EP / expert TP) do not fit the model."""
    _layout(tp, pp, ep, etp, moe=hf.is_moe).check(hf)
    if (not hf.is_moe or hf.first_k_dense) and hf.intermediate_size % tp:
        raise ValueError(
            f"tp={tp} must divide intermediate_size={hf.intermediate_size}; pick another tp"
        )


def check_output_dir(out_dir: str | os.PathLike, *, force: bool, inputs: Sequence = ()) -> None:
    """ValueError if ``out_dir`` has files (unless ``force``) or would overwrite an input."""
    out = Path(out_dir).resolve()
    for path in inputs:
        src = Path(path).resolve()
        if out == src or out in src.parents:
            raise ValueError(f"output {out_dir} would overwrite the input {path}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out_dir} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"output {out_dir} is not empty; pass --force to replace its contents")


def prepare_output_dir(out_dir: str | os.PathLike, *, force: bool, inputs: Sequence = ()) -> None:
    """``check_output_dir``, then create ``out_dir`` empty (emptying it under ``force``)."""
    check_output_dir(out_dir, force=force, inputs=inputs)
    out = Path(out_dir)
    if out.is_dir() and any(out.iterdir()):
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def hf_to_mcore(
    source: HFSource,
    out_dir: str | os.PathLike,
    *,
    force: bool = False,
    origin: Mapping[str, Any] | None = None,
) -> CheckpointMetadata:
    """Write the Megatron checkpoint of ``source`` at the current ``parallel_state`` layout.

    Collective: every rank of the default group (TP x PP ranks, or multiples: data-parallel
    replicas do not write twice) reads only its pipeline stage's HF tensors, one at a time,
    keeps its TP slice of each, and saves. Rank 0 empties ``out_dir`` first under ``force``."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    etp = ps.get_expert_tensor_parallel_world_size()
    check_layout(source.hf, tp, pp, ep, etp)
    if dist.get_rank() == 0:
        prepare_output_dir(out_dir, force=force, inputs=[source.checkpoint.path])
    collectives.barrier(None)
    state = _converted_state(source, tp, pp, ep, etp)
    _split_fused(state)
    meta = make_metadata(
        source.checkpoint.config,
        head=source.head,
        tp=tp,
        pp=pp,
        dtype=source.dtype,
        origin={
            "source": str(source.checkpoint.path.resolve()),
            "critic_from": source.critic_from,
            **({"ep": ep, "etp": etp} if source.hf.is_moe else {}),
            **({MTP_ORIGIN: MTP_IN_MODEL} if source.mtp else {}),
            **(origin or {}),
        },
    )
    save_sharded_state(state, out_dir, meta)
    if dist.get_rank() == 0:
        assets = Path(out_dir) / ASSETS_DIR
        assets.mkdir()
        hf_io.copy_assets(source.checkpoint.path, assets)
        if source.hf.mtp_num_layers and not source.mtp:  # frozen, as they are (weights/mtp.py)
            tensors = mtp_tensors(source.checkpoint.path, source.hf)
            write_mtp(tensors, out_dir, source.checkpoint.config)
    collectives.barrier(None)
    return meta


def _converted_state(source: HFSource, tp: int, pp: int, ep: int, etp: int) -> dict[str, Any]:
    """This rank's sharded state dict, made from its stage's HF tensors (its EP rank's
    experts): the meta-device model takes the record's shards as its parameters (``assign``),
    so they are the only copy."""
    from megatron.core import parallel_state as ps

    (model,), config = _meta_model(
        source.hf, source.head, tp, pp, source.dtype, ep, etp, mtp=source.mtp
    )
    record = source.record()
    chunk = ModelChunk.for_stage(
        config,
        ps.get_pipeline_model_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
    )
    shards = record.hf_to_megatron_shards(
        _hf_stream(source, record, chunk),
        ps.get_tensor_model_parallel_rank(),
        tp,
        chunk,
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp_size=etp,
    )
    _, unexpected = model.load_state_dict(shards, strict=False, assign=True)
    still_meta = [name for name, param in model.named_parameters() if param.is_meta]
    assert not unexpected and not still_meta, (unexpected, still_meta)
    return {"model0": model.sharded_state_dict()}


def _split_fused(state: dict[str, Any]) -> None:
    """Replace each factory (fused fc1) by the two halves it would save, each in its own memory.

    megatron's writer copies every view into a larger storage before writing, as fc1's gate and
    up halves are: ~60% of a Qwen2 model at once. Copied here one fc1 at a time, releasing the
    fused tensor, the peak stays at one copy of the shards."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    for sub in state.values():
        for key in list(sub):
            if isinstance(sub[key], ShardedTensorFactory):
                halves = sub[key].build()
                sub[key] = [dataclasses.replace(h, data=h.data.clone()) for h in halves]
                del halves  # with them goes the last reference to the fused tensor


def _hf_stream(
    source: HFSource, record: ModelRecord, chunk: ModelChunk
) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors ``chunk`` needs, read lazily and cast to the checkpoint dtype."""
    names = record.hf_names(chunk)
    fresh_head = source.critic_from == "policy" and "score.weight" in names
    if fresh_head:
        names.remove("score.weight")
    for name, tensor in source.checkpoint.read(names):
        yield name, tensor.to(source.dtype)
    if fresh_head:  # the value head starts at zero, as ValueHead does
        yield "score.weight", torch.zeros(1, source.hf.hidden_size, dtype=source.dtype)


# ----- Megatron -> HF -----


def mcore_to_hf(
    ckpt_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    hf_config_dir: str | os.PathLike | None = None,
    force: bool = False,
    max_shard_bytes: int = hf_io.DEFAULT_MAX_SHARD_BYTES,
) -> CheckpointMetadata:
    """Write the HF directory (config.json, safetensors shards, index, assets) of a checkpoint.

    One process (a one-rank process group, initialised here when absent). The checkpoint may
    have been saved at any TP/PP: it is read at TP=1/PP=1, one decoder layer at a time.
    ``hf_config_dir``: take ``config.json`` and the tokenizer files from there instead (its
    model must be the checkpoint's)."""
    from megatron.core import dist_checkpointing

    meta = load_metadata(ckpt_dir)
    hf_config = meta.hf_config
    assets_from = Path(ckpt_dir) / ASSETS_DIR
    if hf_config_dir is not None:
        given = hf_io.read_config(hf_config_dir)
        check_compatible(meta, HFModelConfig.from_hf(given), meta.head, ckpt_dir)
        hf_config = make_metadata(
            given, head=meta.head, tp=1, pp=1, dtype=meta.torch_dtype
        ).hf_config
        assets_from = Path(hf_config_dir)
    check_output_dir(out_dir, force=force, inputs=[ckpt_dir])
    _init_single_process()
    hf = HFModelConfig.from_hf(hf_config)
    mtp = mtp_in_checkpoint(meta)
    record = ModelRecord(hf, meta.head, layer_spec="local", mtp=mtp)  # as _meta_model builds
    prepare_output_dir(out_dir, force=force, inputs=[ckpt_dir])
    (model,), _ = _meta_model(hf, meta.head, 1, 1, meta.torch_dtype, mtp=mtp)
    sharded = model.sharded_state_dict()
    writer = hf_io.SafetensorsWriter(out_dir, max_shard_bytes)
    chunk = ModelChunk.whole(hf.num_layers)
    shared = {}  # what the MTP layers' copies copy (in the model: trained)
    for group in _load_groups(record.tensor_maps(chunk)):
        requests = {name: _read_request(sharded[name], meta.torch_dtype) for name in group}
        loaded = dist_checkpointing.load(
            {name: parts for name, (parts, _) in requests.items()},
            str(ckpt_dir),
            validate_access_integrity=False,  # a layer is a slice of each stacked tensor
        )
        for name, (_, finish) in requests.items():
            for hf_name, tensor in record.megatron_to_hf(name, [finish(loaded[name])], chunk):
                writer.add(hf_name, tensor)
                if mtp and hf_name in MTP_COPIES:
                    shared[hf_name] = tensor
        del loaded, requests
    for hf_name, tensor in mtp_copies(hf, shared):
        writer.add(hf_name, tensor)
    if hf.mtp_num_layers and not mtp:  # carried beside the model (weights/mtp.py)
        for hf_name, tensor in mtp_tensors(Path(ckpt_dir) / MTP_DIR, hf):
            writer.add(hf_name, tensor)
    writer.close()
    hf_io.write_config(out_dir, hf_config)
    if assets_from.is_dir():
        hf_io.copy_assets(assets_from, out_dir)
    return meta


def _load_groups(maps: Mapping[str, Any]) -> Iterator[list[str]]:
    """Megatron names in loading units: each decoder layer without its routed experts, each
    routed expert (so a 128-expert layer is never held whole), and the rest one by one."""

    def unit(name: str) -> str:
        parts = name.split(".")
        if name.startswith("decoder.layers.") and parts[3:6] == ["mlp", "experts", "local_experts"]:
            return ".".join(parts[:7])
        return ".".join(parts[:3]) if name.startswith("decoder.layers.") else name

    for _, names in itertools.groupby(maps, key=unit):
        yield list(names)


def _read_request(sharded: Any, dtype: torch.dtype) -> tuple[list[Any], Any]:
    """(what to ask dist_checkpointing for, how to make the tensor of what comes back) for one
    tensor of the meta model.

    A decoder layer's tensor is a slice of a tensor stacked over layers (``prepend_axis_num``);
    loading one layer in a one-rank group needs the slice in stacked form (leading axis of 1)
    without a regular grid. Fused fc1 is a factory of two slices (gate, up), concatenated after
    loading. Embedding/output rows past either padding are padding (``allow_shape_mismatch``).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    def stacked(part: ShardedTensor) -> ShardedTensor:
        shape = (1,) * part.prepend_axis_num + tuple(part.local_shape)
        return dataclasses.replace(
            part,
            data=torch.empty(shape, dtype=dtype),
            dtype=dtype,
            local_shape=shape,
            prepend_axis_num=0,
            axis_fragmentations=None,
            replica_id=0,
        )

    if isinstance(sharded, ShardedTensor):
        return [stacked(sharded)], lambda loaded: loaded[0].view(sharded.local_shape)
    parts = sharded.build()  # a ShardedTensorFactory (fc1); building on meta costs nothing
    return [stacked(part) for part in parts], lambda loaded: sharded.merge_fn(
        [x.view(part.local_shape) for x, part in zip(loaded, parts, strict=True)]
    )


# ----- shared -----


def _layout(tp: int, pp: int, ep: int = 1, etp: int | None = None, *, moe: bool):
    """The ModelLayout a conversion builds its model at. Sequence parallelism changes no
    weight; it is on where megatron-core requires it (an MoE model with TP)."""
    from vapo_megatron.config.layout import ModelLayout

    return ModelLayout(tp=tp, pp=pp, ep=ep, etp=etp, sequence_parallel=tp > 1 and moe)


def _meta_model(
    hf: HFModelConfig,
    head: Head,
    tp: int,
    pp: int,
    dtype: torch.dtype,
    ep: int = 1,
    etp: int | None = None,
    *,
    mtp: bool = False,
):
    """This rank's GPTModel chunks on the meta device (no memory) and their TransformerConfig
    (``mtp``: with the MTP layers).

    Always the local layer spec, whatever the machine has (so ``ModelRecord``'s default
    ``layer_spec="local"`` names its parameters): its checkpoint keys are Transformer Engine's
    too, and a TE model loads the result (``checkpoint.load_model_weights``)."""
    from vapo_megatron.models.provider import build_model, local_spec, transformer_config

    layout = _layout(tp, pp, ep, etp, moe=hf.is_moe)
    config = transformer_config(hf, layout, params_dtype=dtype, mtp=mtp)
    config.perform_initialization = False
    with torch.device("meta"):
        return build_model(hf, config, head=head, layer_spec=local_spec(hf)), config


def _init_single_process() -> None:
    """A one-rank gloo group and TP=1/PP=1 parallel state, unless a group exists already."""
    from vapo_megatron.parallel.cpu_shim import initialize_megatron_cpu

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise ValueError(
            f"mcore-to-hf runs as one process, not {dist.get_world_size()}: start it without "
            "torchrun/srun"
        )
    initialize_megatron_cpu(tp=1, pp=1)
