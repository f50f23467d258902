"""``vapo-train RECIPE.yaml [section.key=value ...]``: run VAPO (or a baseline) end to end.

Under torchrun/srun every process is one rank. Started plainly, it starts
``trainer.local_world_size`` local gloo ranks of itself (rank 0 on this console, the others
logging to RUN_DIR/logs/). The steps, top-down, are in ``trainer/loop.py`` and
``trainer/step.py``: resume; critic pretraining; then per step weight sync, rollout, reward,
scoring pass, advantages, critic and policy updates, metrics, checkpoint; export.
Exit status: 0 done (or preempted with a checkpoint), 1 failed, 2 bad recipe or input.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path


def quiet_dependencies() -> None:
    """Hide notes that say nothing about the run (absent TE/apex, deprecations in megatron)."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).* not installed")
    warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")


HARMLESS_VLLM_WARNINGS = (
    "RotaryEmbedding: Failed to load weights",  # each sync: RoPE has no weights to load
    "doesn't allow to use `torch.set_num_threads`",  # CPU: threads are bound at start-up
)
"""vLLM warnings that each step would repeat and that say nothing about the run."""


def _drop_harmless_vllm_warnings(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not any(text in message for text in HARMLESS_VLLM_WARNINGS)


def setup_logging() -> None:
    """One line format for every rank; vLLM's per-step INFO notes (prefix-cache resets after
    each sync) are kept out of the console, so the progress bar and step lines stay readable."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    # The level reaches vLLM's child loggers; a filter must sit on the handlers, since logger
    # filters do not see records propagated from children.
    logging.getLogger("vllm").setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_drop_harmless_vllm_warnings)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="vapo-train", description=__doc__.split("\n")[0])
    parser.add_argument("recipe", help="YAML recipe (recipes/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="section.key=value, value read as YAML")
    dry = parser.add_argument_group("dry run (one process, nothing allocated: trainer/dry_run.py)")
    dry.add_argument("--dry-run", action="store_true", help="build chosen ranks on meta, report")
    dry.add_argument("--world-size", type=int, help="ranks of the job (default: local_world_size)")
    dry.add_argument("--ranks", default="0", help="ranks to stand in for, e.g. 0,17,127")
    dry.add_argument("--model", help="planner preset or config.json (default: model.path)")
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    quiet_dependencies()
    setup_logging()
    args = parse_args(argv)
    from vapo_megatron.parallel.local_launch import relaunch_as_local_ranks, under_launcher
    from vapo_megatron.trainer.recipe import load_recipe

    try:
        config = load_recipe(args.recipe, args.overrides)
        if args.dry_run:
            from vapo_megatron.trainer import dry_run_report

            world = args.world_size or config.trainer.local_world_size
            if not all(r.strip().isdigit() for r in args.ranks.split(",")):
                raise ValueError(f"--ranks {args.ranks!r}: give rank numbers, e.g. 0,17,127")
            ranks = [int(r) for r in args.ranks.split(",")]
            dry_run_report.run(config, model=args.model, world_size=world, ranks=ranks)
            return 0
        if not under_launcher():  # every rank, even a single one, gets the launcher environment
            logs = Path(config.trainer.run_dir) / "logs"
            logging.info(
                "starting %d local ranks (the others log to %s)",
                config.trainer.local_world_size, logs,
            )  # fmt: skip
            return relaunch_as_local_ranks(config.trainer.local_world_size, log_dir=logs)
        from vapo_megatron.trainer.loop import train

        train(config)
    except ValueError as err:
        logging.error("%s", err)
        return 2
    return 0


if __name__ == "__main__":  # megatron's checkpoint writer spawns processes that import this
    sys.exit(main())
