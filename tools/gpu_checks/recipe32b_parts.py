"""Parts: the 32B recipe's training path on one device.

``recipes/vapo_qwen2.5_32b.yaml`` trains both models on one layout (the shard path), with
the distributed optimizer, ``overlap_grad_reduce`` and ``overlap_param_gather``, and full
recompute (block method). Here the tiny model is built that way (CP 1, world 1) from the
same weights as the plain engines, and takes several steps through the step's own public
functions: ``choose_path``, ``step_share``, ``OwnerPath.score`` and
``advantages_and_metrics`` (both models' scoring and GAE on this rank's samples),
``update_minibatch`` (critic then policy on micro-batches
packed once), and ``gather_params`` as the weight sync calls it.

Held: the first step's scoring equals the plain engines' (``scoring``) and its updates'
losses and gradient norms equal the plain engines' (``update_critic``, ``update_policy``):
the distributed optimizer, the overlaps and recompute change how, not what; the recomputed
layer runs its forward twice per micro-batch in an update, the other once; every step moves
both models' weights, and later steps score with the updated policy.
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import contextmanager

import torch
from megatron.core.utils import unwrap_model

from gpu_checks.compare import max_change, param_snapshot
from gpu_checks.context import Context
from gpu_checks.frame import check
from gpu_checks.tiny import LOGIT_TOLERANCE, OPTIM, SEED, TOKEN_BUDGET
from vapo_megatron.config.gpu import GpuSettings
from vapo_megatron.config.recompute import RecomputeSettings
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.step.advantage_exchange import OwnerPath
from vapo_megatron.step.advantages import advantages_and_metrics, logprob_gap_metrics
from vapo_megatron.step.losses import logprob_scoring_fn, value_scoring_fn
from vapo_megatron.step.outputs import StepInputs, StepModels, choose_path
from vapo_megatron.step.scoring_pass import step_share
from vapo_megatron.step.updates import UpdateData, minibatch_indices, update_minibatch
from vapo_megatron.weights.critic import critic_from_policy

STEPS = 3
"""Steps in a row: Adam's state exists from the first; the overlaps' hooks see each step's
micro-batch count anew."""
RECOMPUTE = RecomputeSettings(granularity="full", method="block", num_layers=1)
"""The 32B recipe's recompute (full, block: 24 of 64 layers), here 1 of 2 layers."""
GPU = GpuSettings(overlap_grad_reduce=True, overlap_param_gather=True)
"""The 32B recipe's overlaps, explicitly on (also on CPU); the fusions stay auto (on where the
kernels are installed)."""
UPDATE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
"""Relative difference allowed between the first update's loss or gradient norm here and the
plain engines': the mini-batch's order (and so its packing) differs, nothing else should."""


def shard_engines(ctx: Context, numbers: dict) -> None:
    ctx.results.need("engines")
    settings = dict(
        optim=dataclasses.replace(OPTIM, distributed_optimizer=True), gpu=GPU, recompute=RECOMPUTE
    )
    ctx.shard_policy = ctx.engine("lm", ctx.policy_groups, **settings)
    ctx.shard_policy.load_hf(ctx.policy_tensors)
    ctx.shard_critic = ctx.engine("value", ctx.critic_groups, **settings)
    ctx.shard_critic.load_hf(critic_from_policy(ctx.policy_tensors, ctx.hf, 0.1, SEED))
    for name, engine in (("policy", ctx.shard_policy), ("critic", ctx.shard_critic)):
        opts = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
        numbers[f"{name}_optimizer"] = sorted(
            {f"{type(o).__name__}({type(o.optimizer).__name__})" for o in opts}
        )
        config = engine.config
        check(
            all(type(o).__name__ == "DistributedOptimizer" for o in opts),
            f"{name}: optimizer {numbers[f'{name}_optimizer']}, not megatron's distributed one",
        )
        check(
            engine.gpu.overlap_grad_reduce and engine.gpu.overlap_param_gather,
            f"{name}: overlaps resolved to {engine.gpu}",
        )
        check(config.no_sync_func is not None, f"{name}: no no_sync_func for overlap_grad_reduce")
        got = (config.recompute_granularity, config.recompute_method, config.recompute_num_layers)
        check(got == ("full", "block", 1), f"{name}: recompute {got}")
    numbers["recompute"] = f"{RECOMPUTE.granularity}/{RECOMPUTE.method}/{RECOMPUTE.num_layers}"


def shard_steps(ctx: Context, numbers: dict) -> None:
    ctx.results.need("shard_engines", "scoring")
    rounded: dict[str, list] = {}
    for k in range(1, STEPS + 1):
        out = shard_step(ctx, count_layer_calls=k == 1)
        for key, value in out.items():
            if isinstance(value, int | float):
                rounded.setdefault(key, []).append(float(f"{value:.4g}"))
        if k == 1:
            numbers["layer_calls_in_update"] = out["layer_calls"]
            first_step_matches_plain(ctx, out, numbers)
    numbers.update(rounded)
    gaps = rounded["logprob_gap"]
    check(all(g > gaps[0] for g in gaps[1:]), f"later steps scored with stale weights: {gaps}")


def shard_step(ctx: Context, *, count_layer_calls: bool = False) -> dict:
    """One step of the shard path on the 32B-path engines: scoring and GAE on this rank's
    samples, one mini-batch update of each model, the parameter gather. Returns its numbers
    (checked: finite, weights moved)."""
    policy, critic, step = ctx.shard_policy, ctx.shard_critic, ctx.step
    start = time.perf_counter()
    choice = choose_path([policy, critic], host_group=ctx.host)
    check(choice.name == "shards", f"the step took the {choice.name} path: {choice.reason}")
    ctx.shard_steps_done += 1
    prompts, responses = step.ragged()
    token_counts = step.token_counts()
    (part,) = minibatch_indices(len(token_counts), 1, seed=SEED + ctx.shard_steps_done)
    share = step_share(
        [part], token_counts, responses.lengths(), dp_size=critic.dp_size, dp_rank=critic.dp_rank
    )
    rewards = torch.tensor(step.rewards, dtype=torch.float32, device=HOST)
    # The plain engines' first scoring stands in for the rollout's log-probs: the gap metric
    # is then how far this step's policy has moved from the initial weights.
    models = StepModels(
        policy, critic, logprob_fn=logprob_scoring_fn(policy.vocab_slice, temperature=1.0),
        value_fn=value_scoring_fn(),
    )  # fmt: skip
    route = OwnerPath(models, {"policy": share, "critic": share}, ctx.host, path=choice)
    inputs = StepInputs(prompts, responses, rewards, ctx.old_logprobs)
    scored = route.score(
        models, inputs, algo=ctx.algo, monte_carlo=False, token_budget=TOKEN_BUDGET
    )
    path_metrics = logprob_gap_metrics(scored, inputs)  # as run_step: right after scoring
    fields, step_metrics = advantages_and_metrics(
        ctx.algo, scored, inputs, monte_carlo=False, whiten_advantages=True
    )
    path_metrics.update(step_metrics)
    data = UpdateData(
        prompts=prompts, responses=responses, fields=fields,
        positive=[reward > 0 for reward in step.rewards],
        trainable_policy=[True] * len(token_counts), path=route,
    )  # fmt: skip
    before = {"policy": param_snapshot(policy), "critic": param_snapshot(critic)}
    with count_calls(policy if count_layer_calls else None) as calls:
        critic_metrics, policy_metrics = update_minibatch(
            data, part.tolist(), algo=ctx.algo, policy=policy, critic=critic, temperature=1.0,
            token_budget=TOKEN_BUDGET,
        )  # fmt: skip
    for engine in (policy, critic):
        engine.gather_params()  # as the weight sync does before reading the weights
    out = {
        "seconds": time.perf_counter() - start,
        "value_loss": critic_metrics["value_loss"],
        "critic_grad_norm": critic_metrics["grad_norm"],
        "policy_grad_norm": policy_metrics["grad_norm"],
        "explained_variance": path_metrics["critic/explained_variance"],
        "logprob_gap": path_metrics.get("rollout/logprob_gap", math.nan),
        "policy_change": max_change(before["policy"], policy),
        "critic_change": max_change(before["critic"], critic),
        "layer_calls": calls,
        "fields": fields.arrays,
        "critic_metrics": critic_metrics,
        "policy_metrics": policy_metrics,
    }
    for key in ("value_loss", "critic_grad_norm", "policy_grad_norm"):
        check(math.isfinite(out[key]) and out[key] >= 0, f"{key} = {out[key]}")
    check(out["policy_change"] > 0 and out["critic_change"] > 0, f"weights did not move: {out}")
    return out


def first_step_matches_plain(ctx: Context, out: dict, numbers: dict) -> None:
    """The first step starts from the plain engines' initial weights on the same samples:
    its scoring and its updates must agree with theirs."""
    check(ctx.values is not None and len(ctx.update_metrics) == 2, "needs the plain parts")
    scale = max(1.0, ctx.old_logprobs.abs().max().item(), ctx.values.abs().max().item())
    tolerance = LOGIT_TOLERANCE[ctx.dtype] * scale
    worst = 0.0
    # One DP rank holds every sample, in ascending order: the local buffers are flat order.
    for mine, plain in (("old_logprobs", ctx.old_logprobs), ("old_values", ctx.values)):
        worst = max(worst, (out["fields"][mine] - plain.to(HOST)).abs().max().item())
    numbers.update(scoring_vs_plain=worst, scoring_tolerance=tolerance)
    check(worst <= tolerance, f"shard path scoring vs score_flat: {worst:.3g} > {tolerance:.3g}")
    rel = UPDATE_TOLERANCE[ctx.dtype]
    worst_rel = 0.0
    for model, loss in (("critic", "value_loss"), ("policy", "pg_loss")):
        mine, plain = out[f"{model}_metrics"], ctx.update_metrics[model]
        for key in ("grad_norm", loss, "num_tokens"):
            diff = abs(mine[key] - plain[key]) / max(abs(mine[key]), abs(plain[key]), 1.0)
            worst_rel = max(worst_rel, diff)
            check(diff <= rel, f"{model} {key}: {mine[key]:.6g} here, {plain[key]:.6g} plain")
    numbers["update_vs_plain_rel"] = worst_rel
    calls = out["layer_calls"]
    check(
        len(calls) == 2 and calls[0] == 2 * calls[1] > 0,
        f"policy layer forwards in an update {calls}: the recomputed first layer should run "
        "twice per micro-batch, the second once",
    )


@contextmanager
def count_calls(engine: ModelEngine | None):
    """Within: the number of forward calls of each transformer layer of ``engine`` (a list,
    filled on exit; empty for None)."""
    calls: list[int] = []
    if engine is None:
        yield calls
        return
    layers = [layer for chunk in engine.chunks for layer in unwrap_model(chunk).decoder.layers]
    counts = [0] * len(layers)

    def hook(index: int):
        def count(module, args, output) -> None:
            counts[index] += 1

        return count

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()
        calls.extend(counts)
