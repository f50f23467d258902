"""Model weights as megatron-core distributed checkpoints: the format, save and load.

A checkpoint directory holds what ``dist_checkpointing.save`` writes (``torch_dist`` format:
``.metadata``, ``__{rank}_{i}.distcp``, ``common.pt``, ``metadata.json``) plus
``vapo_checkpoint.json`` (:class:`CheckpointMetadata`): which model it is (HF config,
architecture, head), how the vocabulary was padded, the layout and dtype it was saved at. That
file is written last, so its presence marks a complete checkpoint. ``hf_assets/`` keeps the
tokenizer and other non-weight files of the HF directory it came from.

Keys are megatron-core's own (``GPTModel.sharded_state_dict``): global layer numbers, fused
QKV and fc1 stored in layout-independent form. So a checkpoint saved at one TP x PP loads at
any other (dist_checkpointing reshards on load), including a different vocabulary padding:
megatron marks the embedding and output layer ``allow_shape_mismatch`` and loads the rows both
paddings share, the rows past the vocabulary being padding. What does not reshard is the head:
megatron would load the first row of an LM head into a value head without a word, so
:func:`check_compatible` refuses a policy checkpoint for a critic and vice versa.

:func:`save_model_weights` and :func:`load_model_weights` (this rank's chunks) serve the
trainer; conversion from and to HF is ``weights/convert.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import queue
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from vapo_megatron.models.config import CONFIG_NAME, Head, HFModelConfig
from vapo_megatron.parallel import collectives

METADATA_NAME = "vapo_checkpoint.json"
ASSETS_DIR = "hf_assets"
FORMAT = "vapo-megatron-model-weights"
FORMAT_VERSION = 1
CriticFrom = Literal["policy", "reward-model"]

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True, kw_only=True)
class CheckpointMetadata:
    """What a loader needs to know about a checkpoint before touching its tensors."""

    architecture: str
    """HF architecture of the model: ``Qwen2ForCausalLM`` (policy), ``...ForSequenceClassification``
    (critic)."""
    head: Head
    """'lm' (policy) or 'value' (critic, value head ``output_layer.weight`` [1, hidden])."""
    hf_config: dict[str, Any]
    """The HF ``config.json`` of this model (architecture and dtype as saved); the exporter
    writes it back as is."""
    vocab_size: int
    """Real vocabulary (rows of the HF embedding)."""
    padded_vocab_size: int
    """Rows of the embedding / output layer as saved (vocab_size rounded up to a multiple of
    make_vocab_size_divisible_by * tp)."""
    make_vocab_size_divisible_by: int
    """Megatron's padding unit (times TP)."""
    tp: int
    """Tensor-parallel size it was saved at."""
    pp: int
    """Pipeline-parallel size it was saved at."""
    dtype: str
    """Element type of every tensor: 'bfloat16' or 'float32'."""
    origin: dict[str, Any] = field(default_factory=dict)
    """Where it came from (converter: source directory, critic_from; trainer: step...)."""
    megatron_core_version: str = ""
    """megatron-core that wrote it."""
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def model_config(self) -> HFModelConfig:
        return HFModelConfig.from_hf(self.hf_config)


def make_metadata(
    hf_config: Mapping[str, Any],
    *,
    head: Head,
    tp: int,
    pp: int,
    dtype: torch.dtype,
    origin: Mapping[str, Any] | None = None,
    make_vocab_size_divisible_by: int = 128,
) -> CheckpointMetadata:
    """The metadata of a checkpoint of ``hf_config``'s model saved with this head/layout/dtype.

    The recorded HF config declares the head's architecture (a critic is a one-label sequence
    classifier) and the saved dtype; other keys are kept, so a policy saved in its own dtype
    exports to its original ``config.json``."""
    from megatron.core.package_info import __version__ as megatron_version

    hf = HFModelConfig.from_hf(hf_config)
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"checkpoint dtype must be float32 or bfloat16, got {dtype}")
    config = json.loads(json.dumps(dict(hf_config)))  # a deep, JSON-clean copy
    architecture = hf.hf_architecture(head)
    config["architectures"] = [architecture]
    if head == "value":
        config["id2label"], config["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
        config.pop("num_labels", None)
    if hf.dtype != dtype:
        for key in ("dtype", "torch_dtype"):
            if key in config or key == "dtype":
                config[key] = DTYPE_NAMES[dtype]
    return CheckpointMetadata(
        architecture=architecture,
        head=head,
        hf_config=config,
        vocab_size=hf.vocab_size,
        padded_vocab_size=hf.padded_vocab_size(tp, make_vocab_size_divisible_by),
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        tp=tp,
        pp=pp,
        dtype=DTYPE_NAMES[dtype],
        origin=dict(origin or {}),
        megatron_core_version=megatron_version,
    )


def load_metadata(ckpt_dir: str | os.PathLike) -> CheckpointMetadata:
    """Read ``vapo_checkpoint.json``; ValueError if ``ckpt_dir`` is not a complete checkpoint."""
    file = Path(ckpt_dir) / METADATA_NAME
    if not file.is_file():
        hint = (
            "it looks like a Hugging Face model: convert it with `tools/convert.py hf-to-mcore`"
            if (Path(ckpt_dir) / CONFIG_NAME).is_file()
            else "the save did not finish, or it was not written by vapo-megatron"
        )
        raise ValueError(f"{ckpt_dir} has no {METADATA_NAME}: {hint}")
    raw = json.loads(file.read_text())
    if raw.get("format") != FORMAT or raw.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{file}: format {raw.get('format')!r} version {raw.get('format_version')!r}; this "
            f"code reads {FORMAT!r} version {FORMAT_VERSION}"
        )
    names = {f.name for f in dataclasses.fields(CheckpointMetadata)}
    return CheckpointMetadata(**{k: v for k, v in raw.items() if k in names})


def check_compatible(
    meta: CheckpointMetadata, hf: HFModelConfig, head: Head, ckpt_dir: str | os.PathLike = ""
) -> None:
    """ValueError, with the way out, unless the checkpoint holds this model with this head.
    The layout may differ (resharding on load); the dtype may differ (cast on load)."""
    where = f"{ckpt_dir}: " if ckpt_dir else ""
    if meta.head != head:
        if meta.head == "value":
            raise ValueError(
                f"{where}this is a critic checkpoint ({meta.architecture}, value head); load it "
                "with head='value', or convert the policy with `tools/convert.py hf-to-mcore "
                "--hf POLICY_DIR ...`"
            )
        raise ValueError(
            f"{where}this is a policy checkpoint ({meta.architecture}, LM head); load it with "
            "head='lm', or make a critic from it with `tools/convert.py hf-to-mcore --hf "
            "POLICY_DIR --critic-from policy ...` (or mcore-to-hf first if you only have this "
            "checkpoint)"
        )
    saved = meta.model_config()
    differ = [
        f"{f.name}: checkpoint {getattr(saved, f.name)} != model {getattr(hf, f.name)}"
        for f in dataclasses.fields(HFModelConfig)
        if f.name not in ("dtype", "initializer_range")
        and getattr(saved, f.name) != getattr(hf, f.name)
    ]
    if differ:
        raise ValueError(f"{where}the checkpoint holds another model: " + "; ".join(differ))


def save_model_weights(
    chunks: Sequence[torch.nn.Module],
    ckpt_dir: str | os.PathLike,
    meta: CheckpointMetadata,
    *,
    dp_cp_group: dist.ProcessGroup | None = None,
) -> None:
    """Save this rank's model chunks (GPTModels, optionally wrapped) and the metadata.

    Collective over the default process group. ``ckpt_dir`` must be empty or absent. Keep the
    entry script's work under ``if __name__ == "__main__":`` (the writer forks processes).
    ``dp_cp_group``: the model's data x context group when it has its own process groups
    (otherwise megatron reads ``parallel_state``'s for the replica ids)."""
    from megatron.core.utils import unwrap_model

    state = {
        f"model{i}": _sharded_state_dict(unwrap_model(chunk), dp_cp_group)
        for i, chunk in enumerate(chunks)
    }
    save_sharded_state(state, ckpt_dir, meta)


def save_sharded_state(state: dict, ckpt_dir: str | os.PathLike, meta: CheckpointMetadata) -> None:
    from megatron.core import dist_checkpointing

    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    if any(ckpt_dir.iterdir()):
        raise ValueError(f"{ckpt_dir} is not empty; a checkpoint needs an empty directory")
    collectives.barrier(None)  # every rank saw it empty before anyone writes
    with in_process_write_results():
        dist_checkpointing.save(state, str(ckpt_dir))
    if dist.get_rank() == 0:
        text = json.dumps(dataclasses.asdict(meta), indent=2, sort_keys=True) + "\n"
        (ckpt_dir / METADATA_NAME).write_text(text)
    collectives.barrier(None)


def load_model_weights(
    chunks: Sequence[torch.nn.Module],
    ckpt_dir: str | os.PathLike,
    *,
    hf: HFModelConfig,
    head: Head,
    dp_cp_group: dist.ProcessGroup | None = None,
    host_group: dist.ProcessGroup | None = None,
) -> CheckpointMetadata:
    """Load a checkpoint into this rank's model chunks, at any TP/PP; return its metadata.

    Collective over the default process group. ``host_group``: a gloo group over every rank
    for the key lists every rank compares (None: the default group, which must then be gloo,
    as in the CPU tools). The chunks' parameters may have another dtype
    than the checkpoint's (cast on load). ValueError for another model or head, and for any
    tensor the model asks for that the checkpoint lacks or the checkpoint holds that the model
    does not ask for, with one exception: ``_extra_state`` entries (Transformer Engine's FP8
    metadata; megatron's local modules save None), which are tolerated either way (see
    :func:`_load_tolerating_extra_state`).
    """
    from megatron.core.utils import unwrap_model

    meta = load_metadata(ckpt_dir)
    check_compatible(meta, hf, head, ckpt_dir)
    models = [unwrap_model(chunk) for chunk in chunks]
    sharded = {
        f"model{i}": _sharded_state_dict(model, dp_cp_group) for i, model in enumerate(models)
    }
    loaded = _load_tolerating_extra_state(sharded, ckpt_dir, host_group)
    for i, model in enumerate(models):
        # Modules' _extra_state may be absent here: dropped above, or never in the sharded state
        # dict (megatron leaves TE's core attention out of it); they keep their current state.
        missing, unexpected = model.load_state_dict(loaded[f"model{i}"], strict=False)
        missing = [k for k in missing if not _is_extra_state(k)]
        if missing or unexpected:
            raise ValueError(f"{ckpt_dir}: missing {missing[:8]}, unexpected {unexpected[:8]}")
    return meta


def _load_tolerating_extra_state(
    sharded: dict, ckpt_dir: str | os.PathLike, host_group: dist.ProcessGroup | None
) -> dict:
    """``dist_checkpointing.load`` of ``sharded``, strict except for ``_extra_state`` keys.

    The two layer specs save the same weight keys (megatron's local spec maps its norm keys to
    TE's names) but not the same ``_extra_state`` ShardedObjects: under TE the final norm (TE's
    RMSNorm, TE >= 1.13) has one, under the local spec it does not. So a TE model loading a
    checkpoint of the local spec (``tools/convert.py`` writes those) asks for a key the
    checkpoint lacks, and a local model loading a TE checkpoint leaves one unread. Megatron's
    ``StrictHandling.RETURN_ALL`` loads what both have and returns both sets ("unexpected":
    asked for by this rank, not in the checkpoint, left out of the load; "missing": in the
    checkpoint, asked for by no rank); any key in them other than an ``_extra_state`` is a
    ValueError on every rank (the sets of all ranks are gathered, so that all of them raise).
    A module whose ``_extra_state`` was not in the checkpoint keeps its fresh state, as TE
    itself does for a checkpoint without FP8 metadata.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    loaded, in_checkpoint_only, in_model_only = dist_checkpointing.load(
        sharded, str(ckpt_dir), strict=StrictHandling.RETURN_ALL
    )
    not_loaded = sorted(k for k in in_model_only if not _is_extra_state(k))
    not_asked = sorted(k for k in in_checkpoint_only if not _is_extra_state(k))
    every_rank = collectives.all_gather_objects(not_loaded, host_group)  # gloo: objects
    not_loaded = sorted({key for keys in every_rank for key in keys})
    if not_loaded or not_asked:
        raise ValueError(
            f"{ckpt_dir}: the model and the checkpoint disagree beyond _extra_state entries: "
            f"{len(not_loaded)} tensor(s) the checkpoint lacks {not_loaded[:8]}, "
            f"{len(not_asked)} the model does not have {not_asked[:8]}; is it a checkpoint of "
            "this model (vapo_checkpoint.json) and was it saved completely?"
        )
    tolerated = len(in_model_only) + len(in_checkpoint_only)
    if tolerated and dist.get_rank() == 0:
        logger.info(
            "%s: tolerated %d _extra_state entr%s absent from the checkpoint and %d in it that "
            "the model does not have (a checkpoint saved under the other layer spec)",
            ckpt_dir,
            len(in_model_only),
            "y" if len(in_model_only) == 1 else "ies",
            len(in_checkpoint_only),
        )
    return loaded


def _is_extra_state(key: str) -> bool:
    return key.endswith("._extra_state")


def _sharded_state_dict(model: torch.nn.Module, dp_cp_group: dist.ProcessGroup | None) -> dict:
    if dp_cp_group is None:
        return model.sharded_state_dict()
    return model.sharded_state_dict(metadata={"dp_cp_group": dp_cp_group})


@contextlib.contextmanager
def in_process_write_results() -> Iterator[None]:
    """A synchronous save's write results through a plain queue: megatron's writer otherwise
    starts, once per process, a multiprocessing Manager in a *spawned* process that re-imports
    the entry script (~5 s per rank) to carry results that never leave this process."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    previous = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = previous
