"""One training step, as DESIGN.md's "One training step" lists it.

``vapo_step`` (and ``critic_pretrain_step``, which stops after the critic's update) read
top-down: prompts, weight sync, rollout, reward, scoring pass, advantages, mini-batch
updates (critic, then policy), metrics. Every rank runs them in lockstep.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.trainer import advantage_phase as adv
from vapo_megatron.trainer.batching import Ragged, build_samples, dp_share, micro_batches
from vapo_megatron.trainer.loss_fns import (
    logprob_scoring_fn,
    policy_loss_fn,
    value_loss_fn,
    value_scoring_fn,
)
from vapo_megatron.trainer.rollout_phase import (
    RolloutStats,
    Trajectories,
    generate_and_grade,
    sampling_seed,
    shape_rewards,
    varied_groups,
)
from vapo_megatron.trainer.rollout_store import load_rollouts, save_rollouts
from vapo_megatron.trainer.scoring import score_flat
from vapo_megatron.trainer.session import Session
from vapo_megatron.trainer.shard_path import (
    ShardInputs,
    StepShare,
    TokenFields,
    TokenSums,
    choose_path,
    critic_metrics,
    lambda_metrics,
    run_shard_path,
    step_share,
)
from vapo_megatron.trainer.updates import train_on_micro_batches, train_on_share
from vapo_megatron.weights.sync import sync_weights

if TYPE_CHECKING:
    from vapo_megatron.trainer.model_engine import ModelEngine

logger = logging.getLogger("vapo_megatron")
CRITIC_FIELDS = ["returns", "old_values"]
"""Per-token fields the critic's loss reads (``loss_fns.value_loss_fn``)."""
POLICY_FIELDS = ["old_logprobs", "advantages", "positive", "seq_num_tokens"]
"""Per-token fields the policy's loss reads (``loss_fns.policy_loss_fn``)."""


class Timer:
    """Seconds per phase of one step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now


def collect_rollouts(
    session: Session, step: int, *, dynamic: bool
) -> tuple[Trajectories, RolloutStats]:
    """The step's graded trajectories, group by group; with ``dynamic``, only groups whose
    accuracies differ, sampling up to trainer.max_sampling_rounds rounds to fill the step."""
    cfg = session.config
    algo, rollout = cfg.algorithm, cfg.rollout
    n = algo.samples_per_prompt
    stats = RolloutStats()
    kept: list[Trajectories] = []  # whole groups, in order
    num_kept = 0
    rounds = cfg.trainer.max_sampling_rounds if dynamic else 1
    for round_ in range(rounds):
        indices = session.sampler.next_indices(algo.prompts_per_step)
        prompts = [session.train.items[i] for i in indices]
        trajectories = generate_and_grade(
            session.rollout, session.tokenizer, prompts, n=n, temperature=rollout.temperature,
            top_p=rollout.top_p, max_new_tokens=rollout.max_new_tokens,
            stop_token_ids=session.stop_token_ids,
            seed=sampling_seed(cfg.trainer.seed, step, round_, session.replica),
            routing=session.routing, grader_timeout_s=cfg.reward.timeout_s, stats=stats,
            replica=session.replica, num_replicas=session.num_replicas,
            host_group=session.host_group,
        )  # fmt: skip
        stats.rounds += 1
        stats.groups_sampled += len(prompts)
        if dynamic:
            groups = varied_groups(trajectories.acc, n).nonzero().squeeze(1)
        else:
            groups = torch.arange(len(trajectories) // n, device=HOST)
        groups = groups[: algo.prompts_per_step - num_kept]
        kept.append(trajectories.select(_group_samples(groups, n)))
        num_kept += groups.numel()
        if num_kept >= algo.prompts_per_step:
            break
    stats.groups_kept = num_kept
    merged = _concat(kept)
    # No token to carry the reward; dropping only that sample would misalign the group
    # baseline, so the whole group goes (counted).
    empty = (merged.responses.lengths() == 0).view(-1, n)
    stats.empty_responses += int(empty.sum())
    flat = merged.select(_group_samples((~empty.any(1)).nonzero().squeeze(1), n))
    flat.group = torch.arange(len(flat), device=HOST) // n
    shape_rewards(flat, algo, rollout.max_new_tokens)
    return flat, stats


def _group_samples(groups: torch.Tensor, n: int) -> torch.Tensor:
    """[G * n] sample indices of the groups ``groups`` [G] (n consecutive samples each)."""
    return (groups[:, None] * n + torch.arange(n, device=HOST)[None]).reshape(-1)


def _concat(parts: Sequence[Trajectories]) -> Trajectories:
    """The samples of ``parts``, one after the other."""
    if len(parts) == 1:
        return parts[0]
    rows = torch.cat([p.meta_rows() for p in parts])
    return Trajectories.from_rows(
        rows,
        torch.cat([p.prompts.values for p in parts]),
        torch.cat([p.responses.values for p in parts]),
        torch.cat([p.rollout_logprobs for p in parts]),
    )


def minibatch_indices(num_samples: int, num_minibatches: int, seed: int) -> list[torch.Tensor]:
    """A seeded permutation of the step's samples cut into ``num_minibatches`` near-equal parts."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_samples, generator=generator, device=HOST)
    return [part for part in torch.tensor_split(order, num_minibatches) if part.numel()]


def _dp_share(engine: ModelEngine, chosen: list[int], token_counts: list[int]) -> list[int]:
    """The samples of mini-batch ``chosen`` that ``engine``'s data-parallel rank trains on
    (what ``train_on`` would pick from the whole mini-batch), in mini-batch order."""
    share = dp_share([token_counts[i] for i in chosen], engine.dp_size, engine.dp_rank)
    return [chosen[k] for k in share]


def _mean_metrics(parts: Sequence[dict[str, float]], prefix: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in {k for p in parts for k in p}:
        values = [p[name] for p in parts if name in p]
        out[f"{prefix}/{name}"] = sum(values) / len(values)
    return out


@dataclass
class UpdateData:
    """What the mini-batch updates (step 7) read of the step, on every rank."""

    prompts: Ragged
    responses: Ragged
    fields: TokenFields
    """Per-token old_logprobs, advantages, returns and old_values (the scoring's outputs)."""
    positive: list[bool]
    """[S] correct responses (the positive-example LM loss)."""
    trainable_policy: list[bool]
    """[S] samples the policy trains on (False: filtered as overlong)."""
    token_counts: list[int]
    """[S] prompt + response tokens of each sample (the flat path's data-parallel split)."""
    share: StepShare | None
    """The shard path's owners of the step's samples; None on the flat path."""

    def critic_fields(self, i: int, flat: slice) -> dict[str, torch.Tensor]:
        length = flat.stop - flat.start
        return {name: self.fields.of(name, i, length) for name in CRITIC_FIELDS}

    def policy_fields(self, i: int, flat: slice) -> dict[str, torch.Tensor]:
        length = flat.stop - flat.start
        return {
            "old_logprobs": self.fields.of("old_logprobs", i, length),
            "advantages": self.fields.of("advantages", i, length),
            "positive": torch.full((length,), self.positive[i], dtype=torch.bool, device=HOST),
            "seq_num_tokens": torch.full((length,), float(length), device=HOST),
        }

    def both_fields(self, i: int, flat: slice) -> dict[str, torch.Tensor]:
        return {**self.critic_fields(i, flat), **self.policy_fields(i, flat)}

    def mine(self, engine: ModelEngine, chosen: list[int]) -> list[int]:
        """The samples of ``chosen`` that ``engine``'s data-parallel rank trains on."""
        if self.share is not None:  # the samples this rank scored, for the whole step
            return self.share.mine(chosen, engine.dp_rank)
        return _dp_share(engine, chosen, self.token_counts)


def update_minibatch(
    data: UpdateData,
    chosen: list[int],
    *,
    algo: AlgoConfig,
    policy: ModelEngine | None,
    critic: ModelEngine | None,
    temperature: float,
    token_budget: int,
    timer: Timer | None = None,
) -> tuple[dict[str, float] | None, dict[str, float] | None]:
    """One gradient step of the critic, then of the policy, on mini-batch ``chosen`` (sample
    indices of the step); each rank trains on its share. ``policy``/``critic`` None: that
    model takes no update (critic pretraining; no critic). Returns (critic metrics, policy
    metrics), None for a model that took no step (the same on every rank). Collective over
    each model's groups."""
    critic_ids = data.mine(critic, chosen) if critic is not None else None
    trainable = [i for i in chosen if data.trainable_policy[i]] if policy is not None else []
    policy_ids = data.mine(policy, trainable) if trainable else None
    prompts, responses = data.prompts, data.responses
    offsets = responses.offsets
    packed = None
    if data.share is not None and critic_ids is not None and policy_ids == critic_ids:
        # One layout, the same samples: pack once for both models.
        samples = build_samples(
            prompts, responses, critic_ids, offsets, data.both_fields, flat_index=False
        )
        packed = micro_batches(
            samples, critic.layout, cp_rank=critic.cp_rank, token_budget=token_budget,
            field_names=CRITIC_FIELDS + POLICY_FIELDS,
        )  # fmt: skip

    def update(engine, ids, fields_fn, loss, names) -> dict[str, float]:
        """On the micro-batches ``packed`` for both models when given, else packed here."""
        if packed is not None:
            return train_on_micro_batches(engine, packed, len(ids), loss, field_names=names)
        samples = build_samples(prompts, responses, ids, offsets, fields_fn, flat_index=False)
        return train_on_share(engine, samples, loss, field_names=names, token_budget=token_budget)

    critic_out = policy_out = None
    if critic_ids is not None:
        critic_out = update(
            critic, critic_ids, data.critic_fields, lambda norm: value_loss_fn(algo, norm),
            CRITIC_FIELDS,
        )  # fmt: skip
        if timer is not None:
            timer.lap("update_critic")
    if policy_ids is not None:  # None: critic pretraining, or every sample overlong-filtered
        vocab = policy.vocab_slice
        policy_out = update(
            policy, policy_ids, data.policy_fields,
            lambda norm: policy_loss_fn(algo, norm, vocab, temperature=temperature),
            POLICY_FIELDS,
        )  # fmt: skip
        if timer is not None:
            timer.lap("update_policy")
    return critic_out, policy_out


def run_step(
    session: Session, step: int, *, pretrain: bool, pretrain_index: int = 0
) -> dict[str, float]:
    """One step: VAPO (``pretrain=False``) or critic pretraining (frozen policy, Monte-Carlo
    returns, critic updates only; ``pretrain_index`` counts its steps from 1). ``step`` keys
    the step's seeds. Returns the step's metrics (the same on every rank)."""
    cfg = session.config
    algo, trainer = cfg.algorithm, cfg.trainer
    timer = Timer()
    metrics: dict[str, float] = {}
    engines = [e for e in (session.policy, session.critic) if e is not None]
    compute_before = sum(e.compute_seconds for e in engines)

    # 1-2. Weight sync (the policy is frozen during critic pretraining: once is enough).
    if not (pretrain and session.rollout_synced):
        metrics.update(sync_weights(session))
        session.rollout_synced = True
    timer.lap("sync")

    # 3-4. Rollout and reward (dynamic sampling decides on accuracy, not the shaped score).
    offline = cfg.critic_pretrain.offline_rollouts if pretrain else None
    if offline:  # fit the critic to rollouts saved by an earlier run
        trajectories, stats = load_rollouts(offline, pretrain_index), RolloutStats()
    else:
        trajectories, stats = collect_rollouts(
            session, step, dynamic=algo.dynamic_sampling and not pretrain
        )
    if pretrain and cfg.critic_pretrain.save_rollouts and session.rank == 0:
        save_rollouts(session.run_dir / "rollouts", pretrain_index, trajectories)
    session.rollout.sleep()
    timer.lap("rollout_other")
    # Generation and grading happened inside that lap: report them apart, not twice.
    timer.seconds["rollout_other"] -= stats.generate_seconds + stats.reward_seconds
    timer.seconds["rollout"] = stats.generate_seconds
    timer.seconds["reward"] = stats.reward_seconds
    metrics.update(_rollout_metrics(trajectories, stats, cfg.rollout.max_new_tokens))
    if not len(trajectories):
        logger.warning("step %d: no trajectories to train on (all groups filtered)", step)
        metrics["skipped_step"] = 1.0
        return metrics

    # 5-6. Scoring pass (old log-probs at the sampling temperature, values), advantages and
    # critic targets: kept on each DP rank's samples (GAE on the critic's CP shards), or
    # gathered to every rank where the layouts differ (trainer/shard_path.py).
    prompts, responses = trajectories.prompts, trajectories.responses
    budget = trainer.micro_batch_tokens
    uses_critic = algo.uses_critic and session.critic is not None
    scorers = [session.critic] if pretrain else [session.policy]
    if uses_critic and not pretrain:
        scorers.append(session.critic)
    choice = choose_path(scorers, requested=trainer.gae_path, host_group=session.host_group)
    if getattr(session, "data_path", None) != choice.name:
        logger.info(
            "step %d: per-token outputs on the %s path: %s", step, choice.name, choice.reason
        )
        session.data_path = choice.name
    metrics["data/shard_path"] = float(choice.name == "shards")
    num_minibatches = max(1, cfg.samples_per_step // trainer.mini_batch_size)
    token_counts = (prompts.lengths() + responses.lengths()).tolist()

    def parts_of(epoch: int) -> list[torch.Tensor]:
        seed = cfg.trainer.seed * 1_000_003 + step * 101 + epoch
        return minibatch_indices(len(trajectories), num_minibatches, seed)

    share = None
    if choice.name == "shards":
        lead = scorers[-1]
        share = step_share(
            parts_of(0), token_counts, responses.lengths(), dp_size=lead.dp_size,
            dp_rank=lead.dp_rank,
        )  # fmt: skip
        fields, path_metrics = run_shard_path(
            algo, share,
            ShardInputs(prompts, responses, trajectories.reward, trajectories.rollout_logprobs),
            policy=None if pretrain else session.policy,
            critic=session.critic if uses_critic else None,
            logprob_fn=_logprob_fn(session), value_fn=value_scoring_fn(), monte_carlo=pretrain,
            whiten=trainer.whiten_advantages and not pretrain, token_budget=budget,
            host_group=session.host_group,
        )  # fmt: skip
        timer.lap("scoring")  # scoring and GAE interleave on this path: one lap for both
        timer.seconds["advantages"] = 0.0
    else:
        fields, path_metrics = _flat_path(session, trajectories, pretrain=pretrain, timer=timer)
    metrics.update(path_metrics)
    gap = metrics.get("rollout/logprob_gap", 0.0)
    if gap > cfg.rollout.logprob_gap_warn:
        logger.warning(
            "step %d: rollout/trainer log-prob gap %.3g > rollout.logprob_gap_warn=%.3g: "
            "the engine may hold stale or wrongly synced weights",
            step, gap, cfg.rollout.logprob_gap_warn,
        )  # fmt: skip

    # 7. Mini-batches: a critic update, then a policy update, each on the same samples.
    data = UpdateData(
        prompts=prompts, responses=responses, fields=fields,
        positive=(trajectories.acc > 0).tolist(),
        trainable_policy=(
            (~trajectories.truncated).tolist()
            if cfg.reward.overlong_filter
            else [True] * len(trajectories)
        ),
        token_counts=token_counts, share=share,
    )  # fmt: skip
    critic_parts, policy_parts = [], []
    for epoch in range(trainer.ppo_epochs):
        for part in parts_of(epoch):
            critic_out, policy_out = update_minibatch(
                data, part.tolist(), algo=algo,
                policy=None if pretrain else session.policy,
                critic=session.critic if uses_critic else None,
                temperature=cfg.rollout.temperature, token_budget=budget, timer=timer,
            )  # fmt: skip
            if critic_out is not None:
                critic_parts.append(critic_out)
            if policy_out is not None:
                policy_parts.append(policy_out)
    if policy_parts:
        session.rollout_synced = False
    metrics.update(_mean_metrics(critic_parts, "critic"))
    metrics.update(_mean_metrics(policy_parts, "policy"))
    metrics["num_minibatches"] = float(len(critic_parts) or len(policy_parts))

    # 8. Metrics (the checkpoint is the loop's).
    total = sum(timer.seconds.values())
    for phase, seconds in timer.seconds.items():
        metrics[f"time/{phase}"] = seconds
    metrics["time/step"] = total
    # Our own overhead: everything but vLLM generation and Megatron forward/backward/optimizer.
    megatron = sum(e.compute_seconds for e in engines) - compute_before
    metrics["time/megatron"] = megatron
    metrics["time/overhead"] = total - megatron - timer.seconds.get("rollout", 0.0)
    metrics["overhead_fraction"] = metrics["time/overhead"] / total if total > 0 else math.nan
    tokens = int(prompts.offsets[-1]) + int(responses.offsets[-1])
    metrics["tokens_per_second"] = tokens / total if total > 0 else math.nan
    return metrics


def _logprob_fn(session: Session):
    """The policy's scoring function: log-probs at the sampling temperature."""
    return logprob_scoring_fn(
        session.policy.vocab_slice, temperature=session.config.rollout.temperature
    )


def _flat_path(
    session: Session, trajectories: Trajectories, *, pretrain: bool, timer: Timer
) -> tuple[TokenFields, dict[str, float]]:
    """The scoring passes gathered to every rank (``score_flat``), then advantages and critic
    targets over the whole step's flat tokens: any pair of layouts."""
    cfg = session.config
    algo, trainer = cfg.algorithm, cfg.trainer
    prompts, responses = trajectories.prompts, trajectories.responses
    offsets = responses.offsets
    budget = trainer.micro_batch_tokens
    metrics: dict[str, float] = {}
    arrays: dict[str, torch.Tensor] = {}
    if not pretrain:
        arrays["old_logprobs"] = old_logprobs = score_flat(
            session.policy, prompts, responses, output_key="logprobs", token_budget=budget,
            scoring_fn=_logprob_fn(session),
        )  # fmt: skip
        rollout_lp = trajectories.rollout_logprobs
        metrics["rollout/logprob_gap"] = (
            (torch.exp(rollout_lp - old_logprobs) - 1).abs().mean().item()
        )
    values = None
    if algo.uses_critic and session.critic is not None:
        # Temperature is the policy's; the critic's values are never divided by it.
        arrays["old_values"] = values = score_flat(
            session.critic, prompts, responses, output_key="values", token_budget=budget,
            scoring_fn=value_scoring_fn(),
        )  # fmt: skip
    timer.lap("scoring")

    rewards = trajectories.reward
    advantages = returns = None
    if pretrain:
        returns = adv.monte_carlo_returns(rewards, values, offsets)
    elif algo.uses_critic:
        advantages, returns, lam_policy = adv.gae_advantages(algo, rewards, values, offsets)
        metrics.update(lambda_metrics(lam_policy))
    else:
        advantages = adv.group_advantages(algo, rewards, offsets)
    if advantages is not None and trainer.whiten_advantages:
        advantages = adv.whiten(advantages)
    everything = TokenSums(None, None)
    if values is not None:
        metrics.update(critic_metrics(everything, returns, values, int(offsets[-1])))
    if advantages is not None:
        mean, std = everything.mean_std(advantages)
        metrics["advantages/mean"] = mean
        metrics["advantages/std"] = std
        arrays["advantages"] = advantages
    if returns is not None:
        arrays["returns"] = returns
    timer.lap("advantages")
    return TokenFields(offsets[:-1].tolist(), arrays), metrics


def _rollout_metrics(
    trajectories: Trajectories, stats: RolloutStats, max_new_tokens: int
) -> dict[str, float]:
    out = {
        "rollout/rounds": float(stats.rounds),
        "rollout/groups_sampled": float(stats.groups_sampled),
        "rollout/groups_kept": float(stats.groups_kept),
        "rollout/grader_errors": float(stats.grader_errors),
        "rollout/grader_timeouts": float(stats.grader_timeouts),
        "rollout/empty_responses": float(stats.empty_responses),
        "num_samples": float(len(trajectories)),
    }
    if len(trajectories):
        lengths = trajectories.responses.lengths().to(torch.float64)
        out.update(
            {
                "score": trajectories.score.mean().item(),
                "reward": trajectories.reward.mean().item(),
                "acc": trajectories.acc.mean().item(),
                "response_length/mean": lengths.mean().item(),
                "response_length/max": lengths.max().item(),
                "response_length/clip_frac": trajectories.truncated.double().mean().item(),
            }
        )
    return out
