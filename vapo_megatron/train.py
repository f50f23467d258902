"""``vapo-train RECIPE.yaml [section.key=value ...]``: run VAPO (or a baseline) end to end.

Under torchrun/srun every process is one rank. Started plainly, it starts
``trainer.local_world_size`` local gloo ranks of itself (rank 0 on this console, the others'
consoles in RUN_DIR/logs/); every rank logs everything, libraries' notes included, to
RUN_DIR/logs/rank{r}.log (``run_log``). The steps, top-down, are in ``trainer/loop.py`` and
``step/run.py``: resume; critic pretraining; then per step weight sync, rollout, reward,
scoring pass, advantages, critic and policy updates, metrics, checkpoint; export.
Exit status: 0 done (or preempted with a checkpoint), 1 failed, 2 bad recipe or input.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from pathlib import Path

from vapo_megatron.run_log import open_rank_log, quiet_dependencies, setup_logging


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="vapo-train", description=__doc__.split("\n")[0])
    parser.add_argument("recipe", help="YAML recipe (recipes/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="section.key=value, value read as YAML")
    dry = parser.add_argument_group("dry run (one process, nothing allocated: planning/dry_run.py)")
    dry.add_argument("--dry-run", action="store_true", help="build chosen ranks on meta, report")
    dry.add_argument("--world-size", type=int, help="ranks of the job (default: local_world_size)")
    dry.add_argument("--ranks", default="0", help="ranks to stand in for, e.g. 0,17,127")
    dry.add_argument("--model", help="planner preset or config.json (default: model.path)")
    return parser.parse_intermixed_args(argv)


def check_before_ranks(config, world_size: int) -> None:
    """The ranks' start-up checks of the recipe (``TrainConfig.check``, each layout against
    its model and the world, a critic.init_path that is not there), run once before any rank
    starts: a bad recipe fails in seconds, not after the ranks have imported everything, with
    the message a rank would give. A model not yet written (model.create_tiny's first run) is
    checked by the ranks."""
    from vapo_megatron.config.checks import check_critic_start, check_layouts_on_models
    from vapo_megatron.weights import hf_io

    config.check(world_size)
    models = hf_io.written_model_configs(config)
    # The separate placement: the models' layouts fit the ranks that train.
    trainer_world = world_size - config.rollout.rollout_world(world_size)
    check_layouts_on_models(config, models, trainer_world)
    # A run directory's pretrained critic (complete or not: the ranks look closer) skips it.
    pretrained = Path(config.trainer.run_dir) / "critic_pretrained"
    check_critic_start(config, has_pretrained_critic=pretrained.exists())


def main(argv: list[str] | None = None) -> int:
    quiet_dependencies()
    args = parse_args(argv)
    from vapo_megatron.config.recipe import load_recipe
    from vapo_megatron.launch.local_launch import relaunch_as_local_ranks, under_launcher

    # A plain start only checks the recipe and starts the ranks: no transformers to route.
    setup_logging(route_transformers=args.dry_run or under_launcher())

    try:
        config = load_recipe(args.recipe, args.overrides)
        if args.dry_run:
            from vapo_megatron.planning import dry_run_report

            world = args.world_size or config.trainer.local_world_size
            if not all(r.strip().isdigit() for r in args.ranks.split(",")):
                raise ValueError(f"--ranks {args.ranks!r}: give rank numbers, e.g. 0,17,127")
            ranks = [int(r) for r in args.ranks.split(",")]
            dry_run_report.run(config, model=args.model, world_size=world, ranks=ranks)
            return 0
        if not under_launcher():  # every rank, even a single one, gets the launcher environment
            check_before_ranks(config, config.trainer.local_world_size)
            logs = Path(config.trainer.run_dir) / "logs"
            logging.info(
                "starting %d local ranks (the others log to %s)",
                config.trainer.local_world_size, logs,
            )  # fmt: skip
            return relaunch_as_local_ranks(config.trainer.local_world_size, log_dir=logs)
        from vapo_megatron.launch.host_malloc import keep_freed_heap
        from vapo_megatron.trainer.loop import train

        open_rank_log(Path(config.trainer.run_dir) / "logs")
        keep_freed_heap()  # the step's freed host memory reused, not faulted in again
        train(config)
    except ValueError as err:
        logging.error("%s", err)
        return 2
    return 0


if __name__ == "__main__":  # megatron's checkpoint writer spawns processes that import this
    try:
        code = main()
    except Exception:  # a failed rank must not linger on a library's non-daemon thread,
        traceback.print_exc()  # holding the launcher (and the others' collectives) until timeout
        sys.stderr.flush()
        os._exit(1)
    sys.exit(code)
