"""Held-out evaluation: avg@k and pass@k with the eval set's own sampling.

avg@k: the mean accuracy over all k samples of every prompt. pass@k: the fraction of prompts
with at least one correct sample among their k (the paper reports avg@32 on AIME 2024 at
temperature 1.0, top_p 0.7). Each engine replica generates for its share of the prompts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from vapo_megatron.step.context import StepContext
from vapo_megatron.step.rollout import RolloutStats, generate_and_grade, sampling_seed

EVAL_SEED_OFFSET = 7_777_777


def evaluate(ctx: StepContext, step: int, prompts: Sequence) -> dict[str, float]:
    """avg@k, pass@k, mean response length and grader failures on ``prompts`` (the eval set's
    items; every rank), with the engine synced to the policy first where it is stale."""
    cfg = ctx.config
    ev = cfg.eval
    items = list(prompts)
    if ev.max_prompts is not None:
        items = items[: ev.max_prompts]
    if not ctx.rollout_synced:
        from vapo_megatron.step.weight_sync import sync_weights

        sync_weights(ctx)
        ctx.weights_current = True
    stats = RolloutStats()
    trajectories = generate_and_grade(
        ctx.rollout, ctx.tokenizer, items, n=ev.k, temperature=ev.temperature,
        top_p=ev.top_p, max_new_tokens=ev.max_new_tokens or cfg.rollout.max_new_tokens,
        stop_token_ids=ctx.stop_token_ids,
        seed=sampling_seed(cfg.trainer.seed + EVAL_SEED_OFFSET, step, 0, ctx.replica),
        routing=ctx.routing, grader_timeout_s=cfg.reward.timeout_s, stats=stats,
        replica=ctx.replica, num_replicas=ctx.num_replicas,
        host_group=ctx.host_group,
    )  # fmt: skip
    if ctx.engine_sleeps:
        ctx.rollout.sleep()
    k = ev.k
    per_prompt = trajectories.acc.view(-1, k).mean(1)  # [prompts] float64
    num_groups = per_prompt.numel()
    # Standard error of avg@k over prompts: the spread of per-prompt accuracies / sqrt(prompts).
    stderr = per_prompt.std().item() / math.sqrt(num_groups) if num_groups > 1 else float("nan")
    num_samples = max(len(trajectories), 1)
    return {
        f"avg@{k}": trajectories.acc.sum().item() / num_samples,
        f"avg@{k}/stderr": stderr,
        f"pass@{k}": (trajectories.acc.view(-1, k) > 0).any(1).sum().item() / max(num_groups, 1),
        "response_length/mean": int(trajectories.responses.offsets[-1]) / num_samples,
        "num_prompts": float(num_groups),
        "grader_errors": float(stats.grader_errors),
        "grader_timeouts": float(stats.grader_timeouts),
        "seconds": stats.generate_seconds + stats.reward_seconds,
    }


class EvalSession:
    """What evaluation needs and nothing more: the tokenizer, the eval prompts and a rollout
    engine started from an HF directory (``vapo-eval``; no training models)."""

    def __init__(self, config) -> None:
        import torch.distributed as dist
        from transformers import AutoTokenizer

        from vapo_megatron.parallel.collectives import make_host_group
        from vapo_megatron.rewards.registry import resolve_routing
        from vapo_megatron.trainer import session as train_session

        train_session.init_distributed(train_session.dist_timeout(config))
        self.host_group = make_host_group(train_session.dist_timeout(config))
        tp = config.rollout.tensor_parallel_size
        if dist.get_world_size() % tp:  # only the engines' layout matters here
            raise ValueError(
                f"rollout.tensor_parallel_size={tp} does not divide the {dist.get_world_size()} "
                "ranks; change it or the number of ranks (trainer.local_world_size)"
            )
        self.config = config
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        train_session.import_plugins(config.reward.plugins)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        self.stop_token_ids = train_session.stop_token_ids(self.tokenizer, config.model.path)
        self.routing = resolve_routing(config.reward.routing)
        self.eval = train_session.read_prompts(
            config, config.data.eval_path, self.tokenizer, self.routing
        )
        self.rollout = train_session.start_rollout(config, self.rank)
        self.replica = self.rank // config.rollout.tensor_parallel_size
        self.num_replicas = self.world_size // config.rollout.tensor_parallel_size
        self.context = StepContext(
            config=config, rollout=self.rollout, tokenizer=self.tokenizer,
            stop_token_ids=self.stop_token_ids, routing=self.routing, host_group=self.host_group,
            rank=self.rank, replica=self.replica, num_replicas=self.num_replicas,
            weights_current=True,  # the engine loaded model.path itself
        )  # fmt: skip

    def close(self) -> None:
        import torch.distributed as dist

        from vapo_megatron.parallel.collectives import barrier

        barrier(self.host_group)
        self.rollout.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
