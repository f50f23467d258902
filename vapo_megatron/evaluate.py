"""``vapo-eval RECIPE.yaml [--model HF_DIR] [section.key=value ...]``: avg@k and pass@k only.

Evaluates an HF policy directory (default: the recipe's model.path; e.g. a run's
RUN_DIR/hf_policy) on the recipe's data.eval_path with its eval sampling (eval.k,
eval.temperature, eval.top_p), on vLLM, without building the training models. Started plainly
it runs trainer.local_world_size local ranks (one engine replica each) like vapo-train.
Prints the metrics as the last line (JSON). Exit status: 0 done, 1 failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from vapo_megatron.run_log import open_rank_log, quiet_dependencies, setup_logging


def main(argv: list[str] | None = None) -> int:
    quiet_dependencies()
    setup_logging()
    parser = argparse.ArgumentParser(prog="vapo-eval", description=__doc__.split("\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    parser.add_argument("--model", help="HF policy directory (default: model.path)")
    args = parser.parse_args(argv)
    from vapo_megatron.config.recipe import load_recipe
    from vapo_megatron.launch.local_launch import relaunch_as_local_ranks, under_launcher

    try:
        config = load_recipe(args.recipe, args.overrides)
        if args.model:
            config = dataclasses.replace(
                config, model=dataclasses.replace(config.model, path=args.model)
            )
        if not config.data.eval_path:
            raise ValueError("vapo-eval needs data.eval_path; set it in the recipe or override it")
        if not under_launcher():  # every rank, even a single one, gets the launcher environment
            return relaunch_as_local_ranks(
                config.trainer.local_world_size, log_dir=Path(config.trainer.run_dir) / "logs"
            )
        from vapo_megatron.trainer.evaluation import EvalSession, evaluate

        open_rank_log(Path(config.trainer.run_dir) / "logs")
        session = EvalSession(config)
        try:
            metrics = evaluate(session.context, 0, session.eval.items)
        finally:
            session.close()
    except ValueError as err:
        logging.error("%s", err)
        return 2
    if session.rank == 0:
        print(json.dumps({"model": config.model.path, **metrics}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
