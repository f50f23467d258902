"""What ``vapo-train RECIPE --dry-run`` prints: per rank a table (groups, bytes built beside the
planner's, the checkpoint share, the step share), what was not built, and a JSON summary last.
The building and the figures are ``planning/dry_run.py``'s."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

from vapo_megatron.config.train import TrainConfig
from vapo_megatron.planning.dry_run import FALLBACKS, RankReport, dry_run
from vapo_megatron.planning.presets import read_critic_config, read_model_config
from vapo_megatron.planning.workload import GIB

ROWS = (
    ("params", "params (model tensors)"),
    ("param_buffer", "  their DDP buffer (dist. opt.)"),
    ("grads", "grad buffer (DDP, padded)"),
    ("optimizer", "optimizer (main copy + Adam)"),
    ("checkpoint", "checkpoint written (even split)"),
)
"""Byte figures of the table: key in ``ModelFigures.built`` / ``planned``, label."""


def format_report(report: RankReport) -> str:
    """One rank's table: groups, then bytes built beside the planner's, then its data share."""
    if report.replica is None:
        where = (f"of {report.world_size} trainer ranks: no vLLM (separate placement: ranks "
                 f"{_span(report.replica_ranks)} generate the step's {report.replica_prompts} "
                 "prompts)")  # fmt: skip
    else:
        where = (f"of {report.world_size}: vLLM replica {report.replica} (ranks "
                 f"{_span(report.replica_ranks)}, {report.replica_prompts} prompts of the step)")  # fmt: skip
    lines = [
        f"== rank {report.rank} {where}",
        f"   data path     {report.data_path}",
    ]
    for m in report.models:
        lay, at = m.layout, m.coords
        lines.append(
            f"-- {m.role}: tp{lay['tp']} pp{lay['pp']}"
            + (f" vpp{lay['vpp']}" if "vpp" in lay else "")
            + f" cp{lay['cp']} dp{lay['dp']}"
            + (f" ep{lay['ep']} etp{lay['etp']} edp{lay['edp']}" if "ep" in lay else "")
            + "; this rank "
            f"tp {at['tp']} pp {at['pp']} cp {at['cp']} dp {at['dp']}"
        )
        for name, ranks in m.groups.items():
            lines.append(f"   {name + ' group':14}{_span(ranks)}")
        diff = m.param_count - m.planned_param_count
        note = "equal" if diff == 0 else f"planner {m.planned_param_count:,}, diff {diff:+,}"
        lines.append(f"   parameters    {m.param_count:,} ({note})")
        lines.append(f"   {'':32}{'built GiB':>10}{'planner GiB':>12}{'diff bytes':>16}")
        for key, label in ROWS:
            built, planned = m.built[key], m.planned.get(key)
            cells = f"{built / GIB:10.3f}"
            if planned is not None:
                cells += f"{planned / GIB:12.3f}{built - planned:>+16,}"
            lines.append(f"   {label:32}{cells}")
        c = m.checkpoint
        lines.append(
            f"   checkpoint    writes {c['weights_tensors']} weight shards "
            f"({c['weights_bytes'] / GIB:.3f} GiB) and {c['optimizer_tensors']} optimizer "
            f"shards ({c['optimizer_bytes'] / GIB:.3f} GiB) of the {c['group_tensors']} its "
            f"DP x CP group holds"
        )
        d = m.data
        lines.append(
            f"   step share    {d['samples']} samples, {d['tokens']:,} tokens, "
            f"{d['micro_batches']} micro-batches (synthetic step)"
        )
    return "\n".join(lines)


def _span(ranks: Sequence[int]) -> str:
    """[0, 8, ..., 120] (16) for long lists."""
    ranks = list(ranks)
    if len(ranks) <= 8:
        return str(ranks)
    return f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)})"


def summary(reports: Sequence[RankReport]) -> dict[str, Any]:
    """The JSON the dry run prints last."""
    return {
        "dry_run": True,
        "world_size": reports[0].world_size if reports else None,
        "ranks": [
            {
                "rank": r.rank,
                "vllm_replica": r.replica,
                "vllm_replica_ranks": r.replica_ranks,
                "data_path": r.data_path.split(" ", 1)[0],
                **{
                    m.role: {
                        "layout": m.layout,
                        "coords": m.coords,
                        "groups": m.groups,
                        "param_count": m.param_count,
                        "planned_param_count": m.planned_param_count,
                        "built_bytes": m.built,
                        "planned_bytes": m.planned,
                        "checkpoint": m.checkpoint,
                        "data": m.data,
                    }  # fmt: skip
                    for m in r.models
                },
            }
            for r in reports
        ],
        "not_built": list(FALLBACKS),
    }


def run(config: TrainConfig, *, model: str | None, world_size: int, ranks: Sequence[int]) -> None:
    """``vapo-train RECIPE --dry-run``: print each rank's table, then the JSON summary. The
    critic is critic.model's (a preset or an HF directory), by default the policy's."""
    name, hf = read_model_config(model, config.model.path)
    critic = read_critic_config(None, config)
    critic_hf = None if critic is None else critic[1]
    # Megatron's per-bucket parameter lists and our GPU-settings line, once per rank built.
    for logger in ("megatron", "vapo_megatron"):
        logging.getLogger(logger).setLevel(logging.WARNING)
    started = time.perf_counter()
    reports = dry_run(config, hf, world_size=world_size, ranks=ranks, critic_hf=critic_hf)
    with_critic = "" if critic is None else f" with the critic {critic[0]}"
    print(f"dry run of {name}{with_critic} at world size {world_size}: the trainer's "
          f"groups, models, DDP and optimizer built on meta under the fake backend")  # fmt: skip
    for report in reports:
        print(format_report(report))
    print("not built (the planner's figure stands):")
    for line in FALLBACKS:
        print(f"  - {line}")
    out = summary(reports)
    out["seconds"] = round(time.perf_counter() - started, 1)
    print(f"{len(reports)} rank(s) in {out['seconds']} s")
    print(json.dumps(out))
