"""Rollout, reward and sample selection: the step's prompts -> graded trajectories.

The world's ranks form ``world / rollout TP`` vLLM engine replicas; replica r generates for
its contiguous share of the step's prompt groups, grades its own responses, and one gather
gives every rank the whole step's trajectories in group order. Sampling seeds depend on
(seed, step, round, replica) only: reproducible, and different for every replica.
Dynamic sampling (DAPO) keeps only groups whose *accuracies* differ (not the shaped score),
sampling more rounds until the step is full or ``max_rounds`` is reached.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.algorithms.group_advantages import soft_overlong_penalty
from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.rewards.registry import score_responses


@dataclass
class Trajectory:
    """One sampled response and its grade; identical on every rank after the gather."""

    group: int
    """Index of its prompt group in the step (samples of one prompt are consecutive)."""
    prompt_index: int
    """Row of the prompt in the training set."""
    prompt: list[int]
    """Prompt token ids."""
    response: list[int]
    """Response token ids (ends with EOS unless truncated)."""
    rollout_logprobs: list[float]
    """vLLM's log-prob of each response token."""
    truncated: bool
    """The response hit max_new_tokens."""
    score: float
    """The grader's score (DAPO: +1 / -1)."""
    acc: float
    """1.0 correct, 0.0 wrong."""
    reward: float = 0.0
    """score plus shaping (overlong penalty): what GAE receives at the last response token."""


@dataclass
class RolloutStats:
    """Counts of one step's rollout."""

    rounds: int = 0
    groups_sampled: int = 0
    groups_kept: int = 0
    grader_errors: int = 0
    grader_timeouts: int = 0
    empty_responses: int = 0
    generate_seconds: float = 0.0
    reward_seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def sampling_seed(seed: int, step: int, round_: int, replica: int) -> int:
    """A 31-bit seed for one replica's generate call (vLLM adds prompt/sample offsets)."""
    state = np.random.SeedSequence([seed, step, round_, replica]).generate_state(1)
    return int(state[0] >> 1)


def replica_share(num_groups: int, num_replicas: int, replica: int) -> range:
    """The contiguous groups replica ``replica`` generates."""
    return range(num_groups * replica // num_replicas, num_groups * (replica + 1) // num_replicas)


def generate_and_grade(
    engine,
    tokenizer,
    prompts: Sequence,
    *,
    n: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    seed: int,
    routing: Mapping[str, str],
    grader_timeout_s: float,
    stats: RolloutStats,
    replica: int,
    num_replicas: int,
    host_group: dist.ProcessGroup,
) -> list[Trajectory]:
    """Generate ``n`` responses for this replica's share of ``prompts`` (TokenizedPrompt list,
    the same on every rank), grade them, and gather everyone's: every rank returns all
    ``len(prompts) * n`` trajectories in (group, sample) order. The trajectories and the
    counts travel over ``host_group`` (gloo): they are host data, and while vLLM still holds
    the GPU an object gather on NCCL would stage world x payload bytes on it."""
    import time

    share = replica_share(len(prompts), num_replicas, replica)
    local: list[Trajectory] = []
    start = time.perf_counter()
    outputs = engine.generate(
        [prompts[g].token_ids for g in share], n=n, temperature=temperature, top_p=top_p,
        max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, seed=seed,
    ) if len(share) else []  # fmt: skip
    generated = time.perf_counter()
    texts = [tokenizer.decode(o.response_token_ids, skip_special_tokens=True) for o in outputs]
    items = []
    for o, text in zip(outputs, texts, strict=True):
        record = prompts[share[o.prompt_index]].record
        items.append((record.data_source, text, record.answer))
    results, grading = score_responses(items, routing, timeout_s=grader_timeout_s)
    for o, result in zip(outputs, results, strict=True):
        group = share[o.prompt_index]
        local.append(
            Trajectory(
                group=group,
                prompt_index=prompts[group].record.index,
                prompt=list(prompts[group].token_ids),
                response=list(o.response_token_ids),
                rollout_logprobs=list(o.logprobs),
                truncated=o.finish_reason == "length",
                score=float(result.score),
                acc=float(result.acc),
            )
        )
    counts = torch.tensor(
        [grading.num_errors, grading.num_timeouts, time.perf_counter() - generated,
         generated - start], dtype=torch.float64, device=HOST,
    )  # fmt: skip
    # The ranks of a replica hold the same samples (vLLM TP in lockstep): its first rank alone
    # hands them, and its counts, to the gather; replicas are consecutive rank groups.
    if dist.get_rank() % (dist.get_world_size() // num_replicas):
        local = []
        counts.zero_()
    gathered = collectives.all_gather_objects(local, host_group)
    collectives.all_reduce(counts, host_group)
    counts[2:] /= num_replicas  # mean seconds over replicas
    stats.grader_errors += int(counts[0])
    stats.grader_timeouts += int(counts[1])
    stats.reward_seconds += float(counts[2])
    stats.generate_seconds += float(counts[3])
    trajectories = [t for part in gathered for t in part]
    trajectories.sort(key=lambda t: t.group)  # stable: samples keep their order
    return trajectories


def shape_rewards(trajectories: list[Trajectory], algo: AlgoConfig, max_new_tokens: int) -> None:
    """reward = score (+ DAPO's soft overlong penalty when configured)."""
    if algo.overlong_buffer_len is None:
        for t in trajectories:
            t.reward = t.score
        return
    lengths = torch.tensor([len(t.response) for t in trajectories], device=HOST)
    penalty = soft_overlong_penalty(lengths, max_new_tokens, algo.overlong_buffer_len)
    for t, p in zip(trajectories, penalty.tolist(), strict=True):
        t.reward = t.score + p


def varied_groups(trajectories: Sequence[Trajectory], n: int) -> list[list[Trajectory]]:
    """Groups whose accuracies are not all equal (the dynamic-sampling filter)."""
    groups = [list(trajectories[i : i + n]) for i in range(0, len(trajectories), n)]
    return [g for g in groups if len({t.acc for t in g}) > 1]
