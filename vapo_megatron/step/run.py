"""One training step, as docs/design.md's "One training step" lists it.

``run_step`` (a VAPO step, or a critic-pretraining step that stops after the critic's update)
reads top-down: prompts, weight sync, rollout, reward, scoring pass, advantages, mini-batch
updates (critic, then policy), metrics. Every rank runs it in lockstep.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from vapo_megatron.step.advantage_exchange import OwnerPath
from vapo_megatron.step.advantages import advantages_and_metrics, logprob_gap_metrics
from vapo_megatron.step.critic_routes import step_routes as critic_step_routes
from vapo_megatron.step.engine_routes import routes_to_owners
from vapo_megatron.step.importance import policy_trace_metrics, step_traces
from vapo_megatron.step.losses import logprob_scoring_fn, value_scoring_fn
from vapo_megatron.step.outputs import (
    OutputPath,
    Scored,
    StepInputs,
    StepModels,
    TokenFields,
    choose_path,
)
from vapo_megatron.step.rollout import rollout_metrics, step_rollouts
from vapo_megatron.step.scoring_pass import step_share
from vapo_megatron.step.timing import Timer
from vapo_megatron.step.trajectories import Trajectories
from vapo_megatron.step.updates import UpdateData, epoch_minibatches, run_updates
from vapo_megatron.step.weight_sync import sync_weights

if TYPE_CHECKING:
    from vapo_megatron.step.context import StepContext

logger = logging.getLogger("vapo_megatron")


def run_step(
    ctx: StepContext, step: int, *, pretrain: bool, pretrain_index: int = 0
) -> dict[str, float]:
    """One step: VAPO (``pretrain=False``) or critic pretraining (frozen policy, Monte-Carlo
    returns, critic updates only; ``pretrain_index`` counts its steps from 1). ``step`` keys
    the step's seeds. Returns the step's metrics (the same on every rank)."""
    cfg = ctx.config
    label = f"critic pretraining step {pretrain_index}" if pretrain else f"step {step}"
    models = step_models(ctx, pretrain=pretrain)
    timer = Timer([e for e in (ctx.policy, ctx.critic) if e is not None])
    metrics: dict[str, float] = {}
    # 1-2. Prompts are drawn by the rollout; the weight sync first (the policy is frozen
    # during critic pretraining: once is enough).
    if ctx.remote is None and not (pretrain and ctx.rollout_synced):
        metrics.update(sync_weights(ctx))
        ctx.weights_current = True
    timer.lap("sync")
    # 3-4. Rollout and reward.
    trajectories, stats = step_rollouts(ctx, step, pretrain=pretrain, pretrain_index=pretrain_index)
    timer.lap_rollout(stats)
    metrics.update(rollout_metrics(trajectories, stats, cfg.rollout.max_new_tokens))
    if not len(trajectories):
        logger.warning("%s: no trajectories to train on (all groups filtered)", label)
        metrics["skipped_step"] = 1.0
        return metrics
    # 5. Scoring pass (old log-probs at the sampling temperature, values), on the path that
    # brings each token's outputs to the rank that trains on it (step/outputs.py).
    path = output_path(ctx, models, trajectories, step, label=label)
    metrics["data/shard_path"] = float(path.name == "shards")
    policy_routes = engine_routes(ctx, models, trajectories, path)
    traces = step_traces(cfg.algorithm, trajectories, step, monte_carlo=pretrain)
    inputs = StepInputs(
        trajectories.prompts, trajectories.responses, trajectories.reward,
        trajectories.rollout_logprobs, routes=policy_routes,
        traces=traces if cfg.algorithm.off_policy_correction == "vtrace" else None,
    )  # fmt: skip
    scored = path.score(
        models, inputs, algo=cfg.algorithm, monte_carlo=pretrain,
        token_budget=cfg.trainer.micro_batch_tokens,
    )  # fmt: skip
    metrics.update(logprob_gap_metrics(scored, inputs))
    metrics.update(policy_trace_metrics(scored, inputs, traces))  # measured either way
    if not cfg.algorithm.rollout_correction.enabled:  # nothing else reads them: freed
        trajectories.rollout_logprobs = None
        inputs.rollout_logprobs = None
    timer.lap("scoring")
    # 6. Advantages and critic targets.
    fields, step_stats = advantages_and_metrics(
        cfg.algorithm, scored, inputs, monte_carlo=pretrain,
        whiten_advantages=cfg.trainer.whiten_advantages and not pretrain,
    )  # fmt: skip
    metrics.update(step_stats)
    if not metrics.get("rollout/staleness"):  # a stale batch's gap is the policy's own move
        warn_on_logprob_gap(metrics, label, cfg.rollout.logprob_gap_warn)
    timer.lap("advantages")
    # 7. Mini-batches: a critic update, then a policy update, each on the same samples.
    critic_routes = scored_critic_routes(scored, models, len(trajectories))
    metrics.update(
        update_models(
            ctx, models, trajectories, fields, path, step, timer,
            policy_routes=policy_routes, critic_routes=critic_routes,
        )
    )  # fmt: skip
    if ctx.remote is not None and not pretrain:  # the new weights to the rollout ranks
        buckets = ctx.policy.hf_buckets(cfg.rollout.weight_bucket_bytes)
        metrics.update(ctx.remote.publish(step, buckets))
    # 8. Metrics (the checkpoint is the loop's).
    prompts, responses = trajectories.prompts, trajectories.responses
    metrics.update(timer.metrics(int(prompts.offsets[-1]) + int(responses.offsets[-1])))
    return metrics


def step_models(ctx: StepContext, *, pretrain: bool) -> StepModels:
    """The models that score and train: the critic alone in critic pretraining, the policy
    (and the critic, where the algorithm uses one) otherwise."""
    critic = ctx.critic if ctx.config.algorithm.uses_critic else None
    policy = None if pretrain else ctx.policy
    logprob_fn = None
    if policy is not None:  # log-probs at the sampling temperature
        temperature = ctx.config.rollout.temperature
        logprob_fn = logprob_scoring_fn(policy.vocab_slice, temperature=temperature)
    return StepModels(policy, critic, logprob_fn=logprob_fn, value_fn=value_scoring_fn())


def output_path(
    ctx: StepContext, models: StepModels, trajectories: Trajectories, step: int, *, label: str
) -> OutputPath:
    """Each scoring model's DP ranks own the first epoch's share of each mini-batch for the
    whole step (split by tokens over that model's DP size); where the two models' owners
    differ the critic's advantages are routed to the policy's (``step/advantage_exchange.py``).
    Logged (as ``label``, the step the user sees) when the path changes (``ctx.data_path``). Collective over the host group."""
    cfg = ctx.config
    scorers = models.scorers()
    choice = choose_path(scorers, host_group=ctx.host_group)
    if ctx.data_path != choice.name:
        logger.info("%s: per-token outputs on the %s path: %s", label, choice.name, choice.reason)
        ctx.data_path = choice.name
    responses = trajectories.responses
    token_counts = (trajectories.prompts.lengths() + responses.lengths()).tolist()
    parts = epoch_minibatches(
        len(trajectories), _num_minibatches(ctx), seed=cfg.trainer.seed, step=step, epoch=0
    )
    lengths = responses.lengths()
    shares = {
        role: step_share(parts, token_counts, lengths, dp_size=e.dp_size, dp_rank=e.dp_rank)
        for role, e in (("policy", models.policy), ("critic", models.critic))
        if e is not None
    }
    return OwnerPath(models, shares, ctx.host_group, path=choice)


def update_models(
    ctx: StepContext,
    models: StepModels,
    trajectories: Trajectories,
    fields: TokenFields,
    path: OutputPath,
    step: int,
    timer: Timer,
    *,
    policy_routes: tuple[torch.Tensor, torch.Tensor] | None = None,
    critic_routes: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict[str, float]:
    """Every PPO epoch's mini-batch updates of the step's models; the engine's weights are
    stale once the policy has moved. ``policy_routes``: the engine's routes of this rank's
    policy samples (``engine_routes``); ``critic_routes``: an MoE critic's routes of its
    scoring pass, replayed in its updates (``step/critic_routes.py``)."""
    cfg = ctx.config
    data = UpdateData(
        prompts=trajectories.prompts, responses=trajectories.responses, fields=fields,
        positive=(trajectories.acc > 0).tolist(),
        trainable_policy=(
            (~trajectories.truncated).tolist()
            if cfg.reward.overlong_filter
            else [True] * len(trajectories)
        ),
        path=path, rollout_logprobs=trajectories.rollout_logprobs,
        correction=cfg.algorithm.rollout_correction, routes=policy_routes,
        critic_routes=critic_routes,
    )  # fmt: skip
    num_minibatches = _num_minibatches(ctx)
    metrics = run_updates(
        data,
        lambda epoch: epoch_minibatches(
            len(trajectories), num_minibatches, seed=cfg.trainer.seed, step=step, epoch=epoch
        ),
        epochs=cfg.trainer.ppo_epochs, algo=cfg.algorithm, policy=models.policy,
        critic=models.critic, temperature=cfg.rollout.temperature,
        token_budget=cfg.trainer.micro_batch_tokens, timer=timer,
    )  # fmt: skip
    if any(name.startswith("policy/") for name in metrics):  # the policy took a step
        ctx.weights_current = False
    return metrics


def scored_critic_routes(
    scored: Scored, models: StepModels, num_samples: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An MoE critic's routes of the scoring pass on this rank's samples (routing replay of
    the critic), as ``UpdateData.critic_routes``; None when it keeps none."""
    if scored.critic is None or scored.critic.routes is None:
        return None
    replay = models.critic.router_replay
    return critic_step_routes(scored.critic.routes, num_samples, (len(replay.layers), replay.top_k))


def engine_routes(
    ctx: StepContext, models: StepModels, trajectories: Trajectories, path: OutputPath
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Routing replay of the policy: the engine's routes of the samples this rank's policy
    owns, sent from the ranks that generated them (``step/engine_routes.py``; collective over
    the host group); None without routes or without a policy update (critic pretraining)."""
    if trajectories.route_at is None or models.policy is None:
        return None
    return routes_to_owners(
        trajectories.route_at, trajectories.route_offsets().diff(), trajectories.route_store,
        path.shares["policy"].owners, models.policy.dp_rank, models.policy.router_replay.layers,
        ctx.host_group,
    )  # fmt: skip


def warn_on_logprob_gap(metrics: dict[str, float], label: str, limit: float) -> None:
    """Warn when the engine's log-probs drift from the trainer's; ``label`` names the step as
    the user sees it ("step 7", "critic pretraining step 2")."""
    gap = metrics.get("rollout/logprob_gap", 0.0)
    if gap > limit:
        logger.warning(
            "%s: rollout/trainer log-prob gap %.3g > rollout.logprob_gap_warn=%.3g: "
            "the engine may hold stale or wrongly synced weights",
            label, gap, limit,
        )  # fmt: skip


def _num_minibatches(ctx: StepContext) -> int:
    cfg = ctx.config
    return max(1, cfg.samples_per_step // cfg.trainer.mini_batch_size)
