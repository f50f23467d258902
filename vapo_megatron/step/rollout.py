"""Steps 1, 3 and 4: the step's prompts -> graded trajectories (rollout and reward).

The world's ranks form ``world / rollout TP`` vLLM engine replicas; replica r generates for
its contiguous share of the step's prompt groups, grades its own responses, and tensor
gathers over the gloo host group (token ids, log-probs, one metadata row per sample; nothing
pickled) give every rank the whole step's trajectories in group order. Sampling seeds depend on
(seed, step, round, replica) only: reproducible, and different for every replica.
Dynamic sampling (DAPO) keeps only groups whose *accuracies* differ (not the shaped score),
sampling more rounds until the step is full or ``max_rounds`` is reached.
"""

from __future__ import annotations

import dataclasses
import time
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.algorithms.group_advantages import soft_overlong_penalty
from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.rewards.registry import score_responses
from vapo_megatron.step.engine_routes import RouteStore
from vapo_megatron.step.rollout_store import load_rollouts, save_rollouts
from vapo_megatron.step.trajectories import META_FIELDS, Trajectories, concat, group_samples

if TYPE_CHECKING:
    from vapo_megatron.step.context import StepContext


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
    route_store: RouteStore | None = None,
) -> Trajectories:
    """Generate ``n`` responses for this replica's share of ``prompts`` (TokenizedPrompt list,
    the same on every rank), grade them, and gather everyone's: every rank returns all
    ``len(prompts) * n`` trajectories in (group, sample) order. The trajectories and the
    counts travel over ``host_group`` (gloo) as host tensors: generation output is host data,
    and while vLLM still holds the GPU a gather on NCCL would stage it on the device. With
    ``route_store`` (routing replay) the engine's routes stay in it on the replica's first
    rank; the trajectories say where (``step/engine_routes.py``)."""
    share = replica_share(len(prompts), num_replicas, replica)
    start = time.perf_counter()
    outputs = engine.generate(
        [prompts[g].token_ids for g in share], n=n, temperature=temperature, top_p=top_p,
        max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, seed=seed,
    ) if len(share) else []  # fmt: skip
    generated = time.perf_counter()
    results, grading = _grade(outputs, tokenizer, prompts, share, routing, grader_timeout_s)
    graded = time.perf_counter()  # the copies below are bookkeeping, not grading
    counts = torch.tensor(
        [grading.num_errors, grading.num_timeouts, graded - generated, generated - start],
        dtype=torch.float64, device=HOST,
    )  # fmt: skip
    # The ranks of a replica hold the same samples (vLLM TP in lockstep): its first rank alone
    # hands them, and its counts, to the gather; replicas are consecutive rank groups.
    if dist.get_rank() % (dist.get_world_size() // num_replicas):
        outputs, results = [], []
        counts.zero_()
    local = _local_buffers(outputs, results, prompts, share)
    if route_store is not None:  # the routes stay here; only where they sit is gathered
        rank = dist.get_rank(host_group)
        local.append(_keep_routes(outputs, prompts, share, route_store, rank))
    # The engine's per-token Python lists are copied into ``local``: free them before the
    # gather, which holds every replica's tokens (the host's peak of the step).
    del outputs, results
    return _gather(local, counts, stats, num_replicas, host_group, route_store)


def _keep_routes(
    outputs, prompts: Sequence, share: range, store: RouteStore, rank: int
) -> torch.Tensor:
    """Keep this replica's samples' routes in ``store``; [2 R] int64 (this rank, first row)
    per sample, for the gather (``step/engine_routes.py``)."""
    at = []
    for o in outputs:
        prompt = prompts[share[o.prompt_index]].token_ids
        expected = len(prompt) + len(o.response_token_ids) - 1
        if o.routes is None or o.routes.shape[0] != expected:
            raise RuntimeError(
                f"the engine returned routes of shape "
                f"{None if o.routes is None else tuple(o.routes.shape)} for a sample of "
                f"{expected + 1} tokens: routing replay needs [prompt + response - 1, layers, "
                "top_k] per sample (rollout.record_routes)"
            )
        at.extend((rank, store.add(o.routes)))
    return torch.tensor(at, dtype=torch.long, device=HOST)


def _grade(outputs, tokenizer, prompts: Sequence, share: range, routing, timeout_s: float):
    """(grades, grading counts) of this replica's responses ``outputs``."""
    texts = [
        tokenizer.decode(_ids(o.response_token_ids), skip_special_tokens=True) for o in outputs
    ]
    items = []
    for o, text in zip(outputs, texts, strict=True):
        record = prompts[share[o.prompt_index]].record
        items.append((record.data_source, text, record.answer))
    return score_responses(items, routing, timeout_s=timeout_s)


def _local_buffers(outputs, results, prompts: Sequence, share: range) -> list[torch.Tensor]:
    """This rank's part of the gather: [R * len(META_FIELDS)] float64 metadata, int32 prompt
    and response token ids, float32 rollout log-probs. Each buffer is allocated once at its
    size and each sample copied into it (the engine's ``array``s as views, no per-token
    Python objects); a group's prompt is converted once for its ``n`` samples."""
    meta: list[tuple] = []
    groups = [share[o.prompt_index] for o in outputs]
    prompt_of = {g: _host_ids(prompts[g].token_ids, torch.int32) for g in set(groups)}
    prompt_lengths = [prompt_of[g].numel() for g in groups]
    response_lengths = [len(o.response_token_ids) for o in outputs]
    prompt_ids = torch.empty(sum(prompt_lengths), dtype=torch.int32, device=HOST)
    response_ids = torch.empty(sum(response_lengths), dtype=torch.int32, device=HOST)
    logprobs = torch.empty(sum(response_lengths), dtype=torch.float32, device=HOST)
    at_prompt = at_response = 0
    for o, result, group, p, r in zip(
        outputs, results, groups, prompt_lengths, response_lengths, strict=True
    ):
        if len(o.logprobs) != r:
            raise RuntimeError(
                f"the engine returned {len(o.logprobs)} log-probs for a response of {r} tokens"
            )
        meta.append(
            (group, prompts[group].record.index, p, r, o.finish_reason == "length",
             float(result.score), float(result.acc))
        )  # fmt: skip
        prompt_ids[at_prompt : at_prompt + p] = prompt_of[group]
        if r:
            response_ids[at_response : at_response + r] = _host_ids(
                o.response_token_ids, torch.int32
            )
            logprobs[at_response : at_response + r] = _host_ids(o.logprobs, torch.float32)
        at_prompt, at_response = at_prompt + p, at_response + r
    meta_rows = torch.tensor(meta, dtype=torch.float64, device=HOST).reshape(-1)
    return [meta_rows, prompt_ids, response_ids, logprobs]


def _gather(
    local: list[torch.Tensor],
    counts: torch.Tensor,
    stats: RolloutStats,
    num_replicas: int,
    host_group: dist.ProcessGroup,
    route_store: RouteStore | None = None,
) -> Trajectories:
    """Every replica's trajectories from each rank's ``local`` buffers, in group order; the
    grading counts and seconds ``counts`` summed into ``stats``. With ``route_store`` the
    last buffer says where each sample's routes sit (``_keep_routes``)."""
    gathered_parts = []
    while local:  # each local buffer is freed once gathered: less at the peak
        gathered_parts.append(collectives.all_gather_varlen(local.pop(0), host_group))
    route_at = gathered_parts.pop().view(-1, 2) if route_store is not None else None
    meta_all, prompt_all, response_all, logprob_all = gathered_parts
    collectives.all_reduce(counts, host_group)
    counts[2:] /= num_replicas  # mean seconds over replicas
    stats.grader_errors += int(counts[0])
    stats.grader_timeouts += int(counts[1])
    stats.reward_seconds += float(counts[2])
    stats.generate_seconds += float(counts[3])
    gathered = Trajectories.from_rows(
        meta_all.view(-1, len(META_FIELDS)), prompt_all, response_all, logprob_all,
        route_at, route_store,
    )  # fmt: skip
    # Stable: the samples of a group keep their order.
    return gathered.select(torch.sort(gathered.group, stable=True).indices)


def _ids(tokens) -> list[int]:
    """Token ids as the list the tokenizer takes (the engine hands an ``array('i')``)."""
    return tokens.tolist() if isinstance(tokens, array) else list(tokens)


_TYPECODES = {torch.int32: "i", torch.float32: "f"}
"""The ``array`` type of each dtype the engine hands (``RolloutSample``)."""


def _host_ids(values, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D host tensor of ``values``: a view of an ``array`` of ``dtype``'s own type (what
    the engine hands: ``torch.frombuffer``, no copy), else a converted copy (lists, tuples,
    arrays of another type)."""
    same = isinstance(values, array) and values.typecode == _TYPECODES.get(dtype)
    if same and len(values) and values.itemsize == dtype.itemsize:
        return torch.frombuffer(values, dtype=dtype)
    return torch.tensor(list(values), dtype=dtype, device=HOST)


def shape_rewards(trajectories: Trajectories, algo: AlgoConfig, max_new_tokens: int) -> None:
    """reward = score (+ DAPO's soft overlong penalty when configured), in place."""
    if algo.overlong_buffer_len is None:
        trajectories.reward = trajectories.score.clone()
        return
    lengths = trajectories.responses.lengths()
    penalty = soft_overlong_penalty(lengths, max_new_tokens, algo.overlong_buffer_len)
    trajectories.reward = trajectories.score + penalty.to(torch.float64)


def varied_groups(acc: torch.Tensor, n: int) -> torch.Tensor:
    """[G] bool: the groups (n consecutive samples of acc [G * n]) whose accuracies are not
    all equal (the dynamic-sampling filter)."""
    per_group = acc.view(-1, n)
    return (per_group != per_group[:, :1]).any(1)


def step_rollouts(
    ctx: StepContext, step: int, *, pretrain: bool, pretrain_index: int
) -> tuple[Trajectories, RolloutStats]:
    """The step's graded trajectories: sampled from the policy (dynamic sampling decides on
    accuracy, not the shaped score), or, in critic pretraining with
    critic_pretrain.offline_rollouts, read from an earlier run's saved rollouts. The engine
    sleeps afterwards (training takes the device)."""
    cfg = ctx.config
    offline = cfg.critic_pretrain.offline_rollouts if pretrain else None
    if offline:  # fit the critic to rollouts saved by an earlier run
        trajectories, stats = load_rollouts(offline, pretrain_index), RolloutStats()
    elif ctx.remote is not None:  # the separate placement: made by the rollout ranks
        remote = ctx.remote
        trajectories, stats = (
            remote.take_pretrain(step, pretrain_index) if pretrain else remote.take(step)
        )
    elif not pretrain and ctx.rollout_queue is not None:  # rollout.lag: the fixed schedule
        trajectories, stats = queued_rollouts(ctx, step)
    else:
        dynamic = cfg.algorithm.dynamic_sampling and not pretrain
        trajectories, stats = collect_rollouts(ctx, step, dynamic=dynamic)
    if pretrain and cfg.critic_pretrain.save_rollouts and ctx.rank == 0:
        save_rollouts(ctx.run_dir / "rollouts", pretrain_index, trajectories)
    if ctx.rollout is not None and ctx.engine_sleeps:
        ctx.rollout.sleep()
    return trajectories, stats


def queued_rollouts(ctx: StepContext, step: int) -> tuple[Trajectories, RolloutStats]:
    """Step ``step``'s batch from the rollout queue (``step/rollout_queue.py``), generated
    up to ``rollout.lag`` steps ago; its counts, with the seconds this call spent
    generating and grading the batches it made (the step's own time)."""
    cfg = ctx.config
    dynamic = cfg.algorithm.dynamic_sampling
    batch, made = ctx.rollout_queue.take(
        step, cfg.trainer.steps, lambda target: collect_rollouts(ctx, target, dynamic=dynamic)
    )
    stats = dataclasses.replace(
        batch.stats,
        generate_seconds=sum(s.generate_seconds for s in made),
        reward_seconds=sum(s.reward_seconds for s in made),
        extra={"staleness": float(step - 1 - batch.version), "batches_made": float(len(made))},
    )
    return batch.trajectories, stats


def collect_rollouts(
    ctx: StepContext, step: int, *, dynamic: bool
) -> tuple[Trajectories, RolloutStats]:
    """The step's graded trajectories, group by group; with ``dynamic``, only groups whose
    accuracies differ, sampling up to trainer.max_sampling_rounds rounds to fill the step."""
    cfg = ctx.config
    algo, rollout = cfg.algorithm, cfg.rollout
    n = algo.samples_per_prompt
    stats = RolloutStats()
    kept: list[Trajectories] = []  # whole groups, in order
    num_kept = 0
    # Routing replay: the engine's routes stay where they were generated (engine_routes.py).
    route_shape = getattr(ctx.rollout, "route_shape", None)  # test doubles have none
    route_store = RouteStore(route_shape) if route_shape is not None else None
    rounds = cfg.trainer.max_sampling_rounds if dynamic else 1
    for round_ in range(rounds):
        indices = ctx.sampler.next_indices(algo.prompts_per_step)
        prompts = [ctx.train_prompts[i] for i in indices]
        trajectories = generate_and_grade(
            ctx.rollout, ctx.tokenizer, prompts, n=n, temperature=rollout.temperature,
            top_p=rollout.top_p, max_new_tokens=rollout.max_new_tokens,
            stop_token_ids=ctx.stop_token_ids,
            seed=sampling_seed(cfg.trainer.seed, step, round_, ctx.replica),
            routing=ctx.routing, grader_timeout_s=cfg.reward.timeout_s, stats=stats,
            replica=ctx.replica, num_replicas=ctx.num_replicas,
            host_group=ctx.host_group, route_store=route_store,
        )  # fmt: skip
        stats.rounds += 1
        stats.groups_sampled += len(prompts)
        if dynamic:
            groups = varied_groups(trajectories.acc, n).nonzero().squeeze(1)
        else:
            groups = torch.arange(len(trajectories) // n, device=HOST)
        groups = groups[: algo.prompts_per_step - num_kept]
        kept.append(trajectories.select(group_samples(groups, n)))
        num_kept += groups.numel()
        if num_kept >= algo.prompts_per_step:
            break
    stats.groups_kept = num_kept
    merged = concat(kept)
    # No token to carry the reward; dropping only that sample would misalign the group
    # baseline, so the whole group goes (counted).
    empty = (merged.responses.lengths() == 0).view(-1, n)
    stats.empty_responses += int(empty.sum())
    flat = merged.select(group_samples((~empty.any(1)).nonzero().squeeze(1), n))
    flat.group = torch.arange(len(flat), device=HOST) // n
    shape_rewards(flat, algo, rollout.max_new_tokens)
    return flat, stats


def rollout_metrics(
    trajectories: Trajectories, stats: RolloutStats, max_new_tokens: int
) -> dict[str, float]:
    """The step's rollout counts, scores and response lengths."""
    # Counts of the rollout queue or the rollout ranks ("time/..." names: their waits).
    out = {name if "/" in name else f"rollout/{name}": v for name, v in stats.extra.items()}
    out |= {
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
