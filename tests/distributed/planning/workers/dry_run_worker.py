"""Worker: the real build the dry run stands in for, on gloo with real CPU tensors.

Each rank loads the recipe, starts the trainer's process group and host group
(``session.init_distributed``, ``make_host_group``), builds the groups and engines with the
trainer's own functions (``session.build_groups``, ``session.build_engine``), reads the same
figures the dry run reads (``dry_run.engine_bytes`` after ``dry_run.make_adam_state``), saves one
training checkpoint with the trainer's checkpointer and prints one JSON line:
``DRYRUN-REAL {"rank": r, "policy": {...}, "critic": {...}, "written": {file: bytes}}``.

Usage: python dry_run_worker.py CHECKPOINT_ROOT RECIPE [overrides ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from vapo_megatron.checkpoint.directory import step_dir_name
from vapo_megatron.checkpoint.save import CheckpointSaver
from vapo_megatron.config.recipe import load_recipe
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.collectives import make_host_group
from vapo_megatron.planning import dry_run
from vapo_megatron.trainer.session import build_engine, build_groups, init_distributed
from vapo_megatron.weights import hf_io


def main() -> None:
    root, recipe, *overrides = sys.argv[1:]
    config = load_recipe(recipe, overrides)
    init_distributed()
    host = make_host_group()
    rank = dist.get_rank()
    hf = HFModelConfig.from_hf(hf_io.read_config(config.model.path))
    groups = dict(zip(("policy", "critic"), build_groups(config, host), strict=True))
    out: dict[str, object] = {"rank": rank}
    states = {}
    for role in ("policy", "critic"):
        engine = build_engine(config, hf, role, groups[role])
        dry_run.make_adam_state(engine)  # as after a step: the checkpoint holds the moments
        pg = groups[role].parallel
        out[role] = {
            "groups": {name: dist.get_process_group_ranks(getattr(pg, name))
                       for name in ("tp", "pp", "cp", "dp", "dp_cp")},
            "param_count": sum(p.numel() for c in engine.chunks for p in c.parameters()),
            "built_bytes": dry_run.engine_bytes(engine),
        }  # fmt: skip
        states[role] = engine.trainable_state()
    CheckpointSaver().save(Path(root), 1, states, {}, keep_last=0, group=host)
    # torch_dist names each rank's data files __RANK_*.distcp
    step = Path(root) / step_dir_name(1)
    out["written"] = {
        str(path.relative_to(step)): path.stat().st_size
        for path in sorted(step.rglob(f"__{rank}_*.distcp"))
    }
    print("DRYRUN-REAL " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # megatron's checkpoint writer spawns processes that import this
    main()
