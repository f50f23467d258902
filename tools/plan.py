"""Propose layouts and estimate per-GPU memory of a colocated VAPO job; validate a recipe.

    python tools/plan.py --model qwen2.5-32b --gpu h100-80gb --nodes 16 --gpus-per-node 8 \\
        --prompt-len 2048 --response-len 20480 [--recipe FILE [--set key=value ...]]

With ``--recipe`` the recipe is loaded and checked against the world size by the trainer's own
loader and checks (``load_recipe``, ``TrainConfig.check``, ``check_layout_pair``,
``ModelLayout.check``): exit 2 with the trainer's message when it would refuse to start. Its
layout is then planned as written, and, when it does not fit, the recipe values to change are
listed. A recipe's recompute (policy/critic.recompute), offload
(rollout.offload_training_state), grad_reduce_in_fp32, enforce_eager, rollout.sleep_level and
trainer.checkpoint_async are planned as the trainer will run them; without a recipe
``--recompute`` and ``--offload`` say (vLLM sleeps at level 2, checkpoints are saved
synchronously), and a layout is searched for. "Fits" means every phase leaves ``--min-headroom-gib`` (8) free. Each figure is
labelled exact, measured (on CPU) or estimated, the pinned host memory per GPU and per node by
part (training-state offload, checkpoint staging, vLLM's sleep backups) too; the memory model is
``vapo_megatron/planning/memory.py``. The last line printed is JSON: ``{"fits": ...,
"layout": {...}, "peak_gib": ..., "headroom_gib": ..., "kv_sequences_per_replica": ...,
"rollout_seconds_estimated": ..., ...}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vapo_megatron.config.layout import ModelLayout  # noqa: E402
from vapo_megatron.models.config import HFModelConfig  # noqa: E402
from vapo_megatron.planning import memory as mp  # noqa: E402
from vapo_megatron.planning import placement as pl  # noqa: E402
from vapo_megatron.planning.params import active_param_count, total_param_count  # noqa: E402
from vapo_megatron.planning.plan_report import (  # noqa: E402
    colocated_summary,
    format_placement,
    format_plan,
    plan_summary,
    route_parts,
    separate_summary,
)
from vapo_megatron.planning.presets import GPUS, MODEL_PRESETS, read_critic_config  # noqa: E402
from vapo_megatron.planning.vllm import RolloutLayout  # noqa: E402
from vapo_megatron.planning.workload import FULL_RECOMPUTE, GIB, NO_RECOMPUTE, OFFLOADS, Workload  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help=f"preset {sorted(MODEL_PRESETS)} or an HF config.json "
                        "(or its directory); default: the recipe's model.path")  # fmt: skip
    parser.add_argument("--critic-model", help="the critic's own model: a preset or an HF "
                        "config.json (or its directory); default: the recipe's critic.model, "
                        "else the policy's")  # fmt: skip
    parser.add_argument("--gpu", default="h100-80gb", choices=sorted(GPUS))
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, help="default: recipe data.max_prompt_tokens")
    parser.add_argument("--response-len", type=int, help="default: recipe rollout.max_new_tokens")
    parser.add_argument("--micro-batch-tokens", type=int,
                        help="default: recipe trainer.micro_batch_tokens, else 16384")  # fmt: skip
    parser.add_argument("--recipe", help="a YAML recipe to validate and plan")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="recipe override, as vapo-train takes them (repeatable)")  # fmt: skip
    parser.add_argument("--recompute", choices=["none", "selective", "full"],
                        help="both models, without --recipe (full: uniform, 1 layer); with a "
                        "recipe, policy/critic.recompute (--set) decide")  # fmt: skip
    parser.add_argument("--offload", choices=sorted(OFFLOADS), default="none",
                        help="without --recipe; with one, rollout.offload_training_state")  # fmt: skip
    parser.add_argument("--no-critic", action="store_true", help="GRPO/DAPO (without --recipe)")
    parser.add_argument("--placement", choices=["colocated", "separate"],
                        help="compare the synchronous colocated step with rollouts on ranks of "
                        "their own (default: the recipe's rollout.placement; colocated prints "
                        "no comparison unless named)")  # fmt: skip
    parser.add_argument("--rollout-ranks", type=int,
                        help="separate placement: ranks that generate (default: the recipe's "
                        "rollout.ranks, and the best split searched)")  # fmt: skip
    parser.add_argument(
        "--reserve-gib",
        type=float,
        default=2.0,
        help="per-GPU fragmentation besides the CUDA context and NCCL buffers (counted apart)",
    )
    parser.add_argument("--min-headroom-gib", type=float, default=8.0,
                        help="memory every phase must leave free")  # fmt: skip
    parser.add_argument(
        "--min-concurrent",
        type=float,
        default=4.0,
        help="full-length sequences a vLLM replica must hold (search only)",
    )
    return parser.parse_args(argv)


def read_model(spec: str | None, recipe_model_path: str | None) -> tuple[str, HFModelConfig]:
    if spec is None and recipe_model_path is None:
        raise ValueError("give --model (a preset or config.json) or --recipe")
    from vapo_megatron.planning.presets import read_model_config

    return read_model_config(spec, recipe_model_path)


def check_recipe(
    config, hf: HFModelConfig, critic_hf: HFModelConfig | None, world_size: int
) -> None:
    """The trainer's own refusals, in the order the trainer meets them (the critic's layout
    against its own model, critic_hf; None: the policy's)."""
    from vapo_megatron.config.checks import check_layouts_on_models
    from vapo_megatron.config.layout import check_layout_pair

    config.check(world_size)
    # The model first: an EP on a dense model is that, not an expert-group arithmetic problem.
    models = {"policy": (config.model.path, hf)}
    models["critic"] = (config.critic.model or config.model.path, critic_hf or hf)
    check_layouts_on_models(config, models, world_size)
    check_layout_pair(config.policy.layout, config.critic.layout, world_size)
    for problem in mp.rollout_tp_problems(hf, config.rollout.tensor_parallel_size, world_size):
        raise ValueError(f"rollout.tensor_parallel_size: {problem}")
    config.rollout.rollout_world(world_size)  # separate placement: the ranks split into replicas


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = args.nodes * args.gpus_per_node
    gpu = GPUS[args.gpu]
    config = None
    try:
        if args.recipe:
            from vapo_megatron.config.recipe import load_recipe

            config = load_recipe(args.recipe, args.set)
        name, hf = read_model(args.model, config.model.path if config else None)
        critic = read_critic_config(args.critic_model, config)
        critic_hf = None if critic is None else critic[1]
        if config is not None:
            check_recipe(config, hf, critic_hf, world)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        print(json.dumps({"fits": False, "valid": False, "error": str(err)}))
        return 2
    work = Workload(
        world_size=world,
        prompt_len=args.prompt_len or (config.data.max_prompt_tokens if config else 2048),
        response_len=args.response_len or (config.rollout.max_new_tokens if config else 8192),
        micro_batch_tokens=args.micro_batch_tokens
        or (config.trainer.micro_batch_tokens if config else 16384),
        reserve_bytes=int(args.reserve_gib * GIB),
        gpus_per_node=args.gpus_per_node,
        min_headroom_bytes=int(args.min_headroom_gib * GIB),
        **(recipe_workload(config) if config else cli_workload(args)),
    )
    print(f"model {name}: {describe(hf)}"
          + ("" if critic is None else f"; critic {critic[0]}: {describe(critic[1])}")
          + f"; {args.nodes} node(s) x {args.gpus_per_node} {gpu.name} = {world} GPUs; "
          f"sequences {work.prompt_len} + {work.response_len} tokens, micro-batch "
          f"{work.micro_batch_tokens} tokens")  # fmt: skip
    summary: dict[str, object] = {}
    proposal = as_written = None
    if config is not None:
        critic = config.critic.layout if work.uses_critic else None
        as_written = mp.plan(hf, gpu, config.policy.layout, critic, work, critic_hf=critic_hf)
        routes = route_parts(as_written, hf, critic_hf)
        print(format_plan(as_written, f"recipe {args.recipe} as written", routes))
        summary.update(recipe_fits=as_written.fits, recipe_changes={})
        proposal = as_written
        if not as_written.fits:
            util = mp.max_vllm_utilization(hf, gpu, config.policy.layout, critic, work,
                                           critic_hf=critic_hf)  # fmt: skip
            adjusted = mp.plan(hf, gpu, config.policy.layout, critic,
                               replace(work, gpu_memory_utilization=util),
                               critic_hf=critic_hf)  # fmt: skip
            proposal = adjusted if adjusted.fits else None
            if adjusted.fits:
                summary["recipe_changes"] = {"rollout.gpu_memory_utilization": util}
    if proposal is None:
        proposal = mp.propose(hf, gpu, work, gpus_per_node=args.gpus_per_node,
                              min_concurrent=args.min_concurrent, critic_hf=critic_hf)  # fmt: skip
        if proposal is not None and config is not None:
            summary["recipe_changes"] = recipe_changes(proposal)
    if proposal is None:  # show why the smallest split fails
        first = ModelLayout(tp=min(args.gpus_per_node, hf.num_key_value_heads))
        first = replace(first, sequence_parallel=first.tp > 1)
        proposal = mp.plan(hf, gpu, first, first if work.uses_critic else None, work,
                           critic_hf=critic_hf)  # fmt: skip
        print(f"no layout of {world} GPUs fits; the largest tensor-parallel split inside a node:")
    print(format_plan(proposal, "proposed", route_parts(proposal, hf, critic_hf)))
    for offload in ("optimizer", "rollout"):  # what each offload option would buy
        alt = replace(proposal.workload, offload=offload)
        util = mp.max_vllm_utilization(hf, gpu, proposal.policy, proposal.critic, alt,
                                       critic_hf=critic_hf)  # fmt: skip
        alt = mp.plan(hf, gpu, proposal.policy, proposal.critic,
                      replace(alt, gpu_memory_utilization=util), critic_hf=critic_hf)  # fmt: skip
        if alt.phases:
            train_peak = max(v for k, v in alt.phases.items() if k.endswith("_update"))
            print(f"offload={offload} ({OFFLOADS[offload]}): update peak "
                  f"{train_peak / GIB:.1f} GiB, vLLM could take gpu_memory_utilization "
                  f"{util:.2f} ({alt.concurrent_sequences:.1f} sequences per replica)")  # fmt: skip
    baseline = as_written if config is not None else proposal  # the recipe's layouts
    placement = compare_placements(args, config, baseline, critic_hf)
    if placement:
        summary["placement"] = placement
    routes = route_parts(proposal, hf, critic_hf)
    print(json.dumps({**plan_summary(proposal, routes), **summary}))
    return 0


def compare_placements(args, config, colocated: mp.Plan, critic_hf) -> dict[str, object]:
    """The synchronous colocated step of ``colocated`` against rollouts on ranks of their own
    (``planning/placement.py``): the recipe's split (rollout.ranks, its layouts on the trainer
    ranks, vLLM TP), and the best splits searched with vLLM TP replicas (what the trainer runs)
    and with any rollout layout (data-parallel attention over expert parallelism for MoE);
    each beside the colocated step at the same vLLM layout. Empty unless asked for."""
    placement = args.placement or (config.rollout.placement if config else "colocated")
    if placement != "separate" and args.placement is None:
        return {}
    models = {"lm": (colocated.hf, colocated.policy)}
    if colocated.critic is not None:
        models["value"] = (critic_hf or colocated.hf, colocated.critic)
    work, gpu = colocated.workload, colocated.gpu
    if config is not None and config.rollout.placement == "separate":
        colocated = colocated_counterpart(colocated, critic_hf)
    sync = pl.colocated_step(colocated, models)
    splits = {}
    ranks = args.rollout_ranks
    if ranks is None and config is not None and config.rollout.placement == "separate":
        ranks = config.rollout.rollout_world(work.world_size)
    if ranks is not None:
        layout = RolloutLayout(tp=config.rollout.tensor_parallel_size) if config else None
        splits["recipe split"] = pl.separate_step(models, gpu, work, ranks, search=config is None,
                                                  tp_only=True, layout=layout)  # fmt: skip
    splits["best split, vLLM TP"] = pl.best_split(models, gpu, work, tp_only=True)
    if colocated.hf.is_moe:
        splits["best split, any vLLM layout"] = pl.best_split(models, gpu, work)
    out: dict[str, object] = {"colocated": colocated_summary(sync)}
    found = {}
    for name, split in splits.items():
        if split is None:
            print(f"  {name}: no split fits (trainer layouts or a rollout replica)")
            continue
        same = pl.colocated_step(colocated, models, split.decode.layout)
        found[name] = separate_summary(split, sync, same)
    print(format_placement(out["colocated"], found))
    return {**out, **found}


def colocated_counterpart(result: mp.Plan, critic_hf) -> mp.Plan:
    """A separate recipe's synchronous counterpart: its layouts and vLLM TP colocated on every
    rank, the training state offloaded while vLLM is awake and vLLM at the largest share
    that fits (how the colocated recipes run)."""
    work = replace(result.workload, offload="rollout", sleep_level=2)
    util = mp.max_vllm_utilization(result.hf, result.gpu, result.policy, result.critic, work,
                                   critic_hf=critic_hf)  # fmt: skip
    return mp.plan(result.hf, result.gpu, result.policy, result.critic,
                   replace(work, gpu_memory_utilization=util), critic_hf=critic_hf)  # fmt: skip


def describe(hf: HFModelConfig) -> str:
    """Its size in parameters (MoE: total and active per token, the experts and top-k)."""
    total = f"{total_param_count(hf, head='lm') / 1e9:.2f}e9 parameters"
    if not hf.is_moe:
        return total
    active = active_param_count(hf, head="lm") / 1e9
    return f"{total} ({active:.2f}e9 active: top {hf.moe_top_k} of {hf.num_experts} experts)"


CLI_RECOMPUTE = {"none": NO_RECOMPUTE, "selective": ("selective", None, None),
                 "full": FULL_RECOMPUTE}  # fmt: skip


def cli_workload(args: argparse.Namespace) -> dict[str, object]:
    recompute = CLI_RECOMPUTE[args.recompute or "none"]
    return {"uses_critic": not args.no_critic, "policy_recompute": recompute,
            "critic_recompute": recompute, "offload": args.offload}  # fmt: skip


RECIPE_FIELDS = ("bf16", "distributed_optimizer", "critic_distributed_optimizer", "uses_critic",
                 "policy_recompute", "critic_recompute", "grad_reduce_in_fp32", "rollout_tp",
                 "gpu_memory_utilization", "offload", "enforce_eager", "samples_per_step",
                 "sleep_level", "checkpoint_async", "routing_replay",
                 "critic_routing_replay", "ppo_epochs")  # fmt: skip


def recipe_workload(config) -> dict[str, object]:
    """What the recipe configures and the trainer does with it (not planning-only options),
    read as the dry run reads it (``planning/workload.py::planner_workload``)."""
    from vapo_megatron.planning.workload import planner_workload

    work = planner_workload(config, world_size=1)
    return {name: getattr(work, name) for name in RECIPE_FIELDS}


def recipe_changes(result: mp.Plan) -> dict[str, object]:
    """Recipe keys (dotted, as overrides) that give the proposed layout."""
    changes: dict[str, object] = {}
    for name, layout in (("policy", result.policy), ("critic", result.critic)):
        if layout is None:
            continue
        for key in ("tp", "pp", "cp", "vpp", "sequence_parallel", "ep", "etp"):
            changes[f"{name}.layout.{key}"] = getattr(layout, key)
    changes["rollout.tensor_parallel_size"] = result.workload.rollout_tp
    changes["rollout.gpu_memory_utilization"] = result.workload.gpu_memory_utilization
    return changes


if __name__ == "__main__":
    sys.exit(main())
