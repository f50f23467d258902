"""``model.create_tiny``: the tiny task's splits and model, written where they are missing.

The run's start-up calls :func:`ensure_tiny_assets` on every rank once the process groups
exist: rank 0 writes, the others wait at a barrier (under torchrun or srun there is no parent
process to write them before the ranks start).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from vapo_megatron.parallel import collectives

if TYPE_CHECKING:
    from vapo_megatron.config.train import DataSettings, ModelSettings, TrainConfig

logger = logging.getLogger("vapo_megatron")


def ensure_tiny_assets(config: TrainConfig, host_group: dist.ProcessGroup) -> None:
    """With model.create_tiny, rank 0 builds the tiny task and model where they are missing;
    every rank returns once they are there. Collective over ``host_group``."""
    if not config.model.create_tiny:
        return
    if dist.get_rank() == 0:
        write_missing_tiny_assets(config.model, config.data)
    collectives.barrier(host_group)


def write_missing_tiny_assets(model: ModelSettings, data: DataSettings) -> None:
    """Write the task's splits (data.train_path, data.eval_path) and the tiny model
    (model.path), each only where it is missing (one process)."""
    from vapo_megatron.tiny.model import write_tiny_model
    from vapo_megatron.tiny.synthetic import make_splits

    train_path = Path(data.train_path)
    eval_path = Path(data.eval_path) if data.eval_path else None
    if not train_path.is_file() or (eval_path is not None and not eval_path.is_file()):
        made_train, made_eval = make_splits(
            train_path.parent, model.tiny_num_train, model.tiny_num_eval, model.tiny_seed
        )
        if made_train != train_path or (eval_path is not None and made_eval != eval_path):
            raise ValueError(
                f"model.create_tiny writes {made_train} and {made_eval}; set "
                "data.train_path and data.eval_path to those names"
            )
        logger.info("tiny task written: %s, %s", made_train, made_eval)
    if not (Path(model.path) / "config.json").is_file():
        started = time.perf_counter()
        write_tiny_model(
            model.path, seed=model.tiny_seed, warmup_steps=model.tiny_warmup_steps,
            train_path=train_path, template=data.template, slip_rate=model.tiny_slip_rate,
            guess_rate=model.tiny_guess_rate, family=model.tiny_family,
        )  # fmt: skip
        logger.info(
            "tiny model written to %s (%d warm-up steps, %.0f s)",
            model.path, model.tiny_warmup_steps, time.perf_counter() - started,
        )  # fmt: skip
