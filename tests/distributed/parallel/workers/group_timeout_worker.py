"""Worker: every process group the trainer makes for its two models carries the recipe's
timeout (``trainer.dist_timeout_minutes``). torch gives a group made without ``timeout=`` its
backend's default (NCCL: 10 minutes), not the default group's.

One process stands in for chosen ranks of a WORLD-rank job under torch's fake backend
(``dry_run.stand_in_for``: groups are really constructed, collectives do nothing) and records
every ``torch.distributed.new_group`` call while the trainer's own functions build both
models' groups and engines on meta (``session.build_groups``, ``session.build_engine``:
megatron's DDP and optimizer could make groups of their own). Prints one line:
``GROUPS {"calls": n, "timeouts": {str(timeout): count}, "untimed": [caller, ...]}``.

Usage: python group_timeout_worker.py WORLD RANKS RECIPE [overrides ...]
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import torch.distributed as dist

from vapo_megatron.config.recipe import load_recipe
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.planning import dry_run
from vapo_megatron.trainer.session import build_engine, build_groups

# Small enough to build in seconds, divisible by every layout the test asks for.
HF = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
      "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512,
      "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False}  # fmt: skip


def main() -> None:
    world, ranks, recipe, *overrides = sys.argv[1:]
    config = load_recipe(recipe, overrides)
    hf = HFModelConfig.from_hf(HF)
    timeouts: Counter[str] = Counter()
    untimed: set[str] = set()
    new_group = dist.new_group

    def recording_new_group(*args, **kwargs):
        timeout = kwargs.get("timeout")
        timeouts[str(timeout)] += 1
        if timeout is None:
            caller = sys._getframe(1).f_code
            untimed.add(f"{caller.co_filename}:{caller.co_name}")
        return new_group(*args, **kwargs)

    dist.new_group = recording_new_group
    for rank in map(int, ranks.split(",")):
        with dry_run.stand_in_for(rank, int(world)):
            groups = dict(
                zip(("policy", "critic"), build_groups(config, dist.group.WORLD), strict=True)
            )
            with dry_run.on_meta():
                for role in ("policy", "critic"):
                    gpu = dry_run.dry_run_gpu_settings(config.gpu)
                    build_engine(config, hf, role, groups[role], gpu=gpu)
    report = {"calls": sum(timeouts.values()), "timeouts": timeouts, "untimed": sorted(untimed)}
    print("GROUPS " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
