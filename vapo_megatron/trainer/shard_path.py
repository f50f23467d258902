"""The layout-coupled data path: each data-parallel rank scores, runs GAE on and trains on its
own samples, and no per-token output crosses ranks.

When the policy and the critic split the ranks the same way (one layout), data-parallel rank d
of both models holds the same samples for the whole step: it scores them with both models,
runs decoupled GAE on the critic's context-parallel shards where the values came out
(``advantage_phase.gae_on_cp_shards``: one carry per sequence crosses CP ranks), and trains
both models on them. Per-token results live in *local* buffers: this DP rank's samples'
response tokens end to end (``StepShare``), written at this CP rank's positions. The rest stays
0 and is never read: without a pipeline each sequence is padded on its own
(``batching.MicroBatchPlan``), so every micro-batch it lands in splits it into the same CP
chunks. Only sums cross ranks, over the host group: the step's statistics, the whitening's
mean and std, the coverage check.

Which samples a DP rank owns: the first epoch's mini-batches, each split by token counts
(``batching.dp_owners``) as the flat path splits them, so the first epoch trains every rank on
the same micro-batches either way. Later epochs keep the owners: each mini-batch's update is
the same sum over its samples, only its split over ranks (the float order, the balance)
differs.

The flat path (``trainer/scoring.py``: every token's outputs gathered to every rank, GAE over
the whole step) remains where the layouts differ, and under CP with a pipeline (a pipeline pads
every row to one length, which moves the last sequence's CP chunks). ``choose_path`` decides,
and says why.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vapo_megatron.algorithms.advantages import gae_lambdas
from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.algorithms.group_advantages import group_normalized_advantages
from vapo_megatron.algorithms.losses import explained_variance
from vapo_megatron.data.packing import MicroBatch, Sample
from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.trainer import advantage_phase as adv
from vapo_megatron.trainer.batching import (
    FLAT_INDEX,
    LOCAL_INDEX,
    Ragged,
    build_samples,
    dp_owners,
    empty_micro_batch,
    plan_micro_batches,
)
from vapo_megatron.trainer.model_engine import LossFn, ModelEngine

GAE_PATHS = ("auto", "shards", "flat")
STAT_BLOCK = 1 << 20
"""Tokens per block of the float64 statistics."""
SCORING_CHUNK = 16
"""Micro-batches packed and scored at a time on the shard path (without a pipeline): the
host holds a chunk's packed rows, not the whole share's."""


@dataclass(frozen=True)
class PathChoice:
    name: str
    """"shards" or "flat"."""
    reason: str


def choose_path(
    engines: Sequence[ModelEngine], *, requested: str, host_group: dist.ProcessGroup | None
) -> PathChoice:
    """Where the step's per-token outputs live. ``engines``: the models that score this step
    (policy and/or critic). ``requested``: trainer.gae_path. Collective over ``host_group``
    (every rank takes the same path)."""
    if requested not in GAE_PATHS:
        raise ValueError(f"trainer.gae_path must be one of {GAE_PATHS}, got {requested!r}")
    lead = engines[0]
    reason = ""
    if requested == "flat":
        reason = "trainer.gae_path=flat"
    elif any(e.layout != lead.layout for e in engines):
        reason = (
            f"the policy's layout {engines[0].layout} and the critic's {engines[-1].layout} "
            "differ: each token's values go to the rank that trains on it"
        )
    elif any(_coordinates(e) != _coordinates(lead) for e in engines):
        reason = "the models place this rank at different (tp, pp, cp, dp) coordinates"
    elif lead.layout.cp > 1 and lead.layout.pp > 1:
        reason = (
            f"cp={lead.layout.cp} with pp={lead.layout.pp}: the pipeline pads every row to one "
            "length, which moves a row's last sequence's CP chunks between micro-batches"
        )
    agree = torch.tensor([0 if reason else 1], dtype=torch.int64, device=HOST)
    collectives.all_reduce(agree, host_group, op=dist.ReduceOp.MIN)
    if not reason and not bool(agree):
        reason = "another rank cannot take the shard path"
    if reason:
        if requested == "shards":
            raise ValueError(
                f"trainer.gae_path=shards is not possible here: {reason}; set "
                "trainer.gae_path=auto (or flat)"
            )
        return PathChoice("flat", reason)
    layout = lead.layout
    return PathChoice(
        "shards",
        f"{len(engines)} model(s) on one layout (tp={layout.tp}, pp={layout.pp}, "
        f"cp={layout.cp}, dp={lead.dp_size}): each DP rank keeps its samples' outputs",
    )


def _coordinates(engine: ModelEngine) -> tuple[int, ...]:
    g = engine.groups
    return (g.tp_rank, g.pp_rank, g.cp_rank, g.dp_rank, g.tp_size, g.pp_size, g.cp_size)


@dataclass
class TokenFields:
    """Per-response-token arrays of the step's samples as this rank holds them, and where
    each sample's tokens start in them: the whole step in flat order (flat path), or this DP
    rank's samples end to end (shard path)."""

    start: list[int]
    """Per sample of the step: its first token's position in the arrays (only the samples
    this rank holds are valid)."""
    arrays: dict[str, torch.Tensor]

    def of(self, name: str, i: int, length: int) -> torch.Tensor:
        """Array ``name`` over sample ``i``'s ``length`` response tokens."""
        return self.arrays[name][self.start[i] : self.start[i] + length]


@dataclass
class StepShare:
    """The samples data-parallel rank ``dp_rank`` owns for the whole step."""

    owners: list[int]
    """[S] the DP rank of each sample."""
    ids: torch.Tensor
    """[K] int64 this rank's samples, ascending."""
    start: list[int]
    """[S] first position of each of this rank's samples in the local buffers (0 for others)."""
    num_tokens: int
    """Response tokens of this rank's samples (the local buffers' length)."""

    def mine(self, chosen: Sequence[int], dp_rank: int) -> list[int]:
        """The samples of ``chosen`` this rank trains on, in ``chosen``'s order."""
        return [i for i in chosen if self.owners[i] == dp_rank]


def step_share(
    parts: Sequence[torch.Tensor],
    token_counts: Sequence[int],
    response_lengths: torch.Tensor,
    *,
    dp_size: int,
    dp_rank: int,
) -> StepShare:
    """Owners from the first epoch's mini-batches ``parts`` (each split by ``dp_owners`` of its
    samples' token counts)."""
    owners = [0] * len(token_counts)
    for part in parts:
        chosen = part.tolist()
        ranks = dp_owners([token_counts[i] for i in chosen], dp_size)
        for i, rank in zip(chosen, ranks, strict=True):
            owners[i] = rank
    ids = torch.tensor(
        [i for i, r in enumerate(owners) if r == dp_rank], dtype=torch.long, device=HOST
    )
    lengths = response_lengths[ids]
    starts = torch.zeros(len(owners), dtype=torch.long, device=HOST)
    starts[ids] = lengths.cumsum(0) - lengths
    return StepShare(owners, ids, starts.tolist(), int(lengths.sum()))


@dataclass
class ShardInputs:
    """What the shard path reads of the step (all on the host)."""

    prompts: Ragged
    responses: Ragged
    rewards: torch.Tensor
    """[S] per-sample rewards."""
    rollout_logprobs: torch.Tensor | None
    """[N] the engine's log-probs in flat order (for the gap metric), or None."""


def run_shard_path(
    algo: AlgoConfig,
    share: StepShare,
    inputs: ShardInputs,
    *,
    policy: ModelEngine | None,
    critic: ModelEngine | None,
    logprob_fn: LossFn | None,
    value_fn: LossFn | None,
    monte_carlo: bool,
    whiten: bool,
    token_budget: int,
    host_group: dist.ProcessGroup | None,
) -> tuple[TokenFields, dict[str, float]]:
    """The scoring passes, advantages and returns on this DP rank's samples.

    ``policy`` (with ``logprob_fn``) gives old_logprobs; ``critic`` (with ``value_fn``) gives
    old_values and, by GAE on its CP shards, returns and (unless ``monte_carlo``: critic
    pretraining's lambda = gamma = 1 returns) advantages; without a critic, advantages are the
    group estimator's. Returns the local TokenFields and the step's metrics (global, the same
    on every rank). Collective over the models' groups and ``host_group``."""
    lead = critic if critic is not None else policy
    offsets = inputs.responses.offsets
    lengths = offsets.diff()
    ids = share.ids.tolist()

    cp = lead.layout.cp

    def local_index(i: int, flat: slice) -> dict[str, torch.Tensor]:
        start = share.start[i]
        return {
            LOCAL_INDEX: torch.arange(
                start, start + flat.stop - flat.start, dtype=torch.long, device=HOST
            )
        }

    # Without CP a micro-batch's response tokens, in order, are one contiguous span of the
    # local buffers (its samples are consecutive samples of this rank): a slice, not an index.
    samples = build_samples(
        inputs.prompts, inputs.responses, ids, offsets, local_index if cp > 1 else None,
        flat_index=cp > 1,
    )  # fmt: skip
    names = [FLAT_INDEX, LOCAL_INDEX] if cp > 1 else []
    arrays: dict[str, torch.Tensor] = {}
    outputs = []
    if policy is not None:
        outputs.append(("old_logprobs", policy, logprob_fn, "logprobs"))
    if critic is not None:
        outputs.append(("old_values", critic, value_fn, "values"))
    for name, *_ in outputs:
        arrays[name] = torch.zeros(share.num_tokens, dtype=torch.float32, device=HOST)
    if critic is not None and cp > 1:  # filled shard by shard (without CP: by one scan below)
        arrays["returns"] = torch.zeros(share.num_tokens, dtype=torch.float32, device=HOST)
        if not monte_carlo:
            arrays["advantages"] = torch.zeros(share.num_tokens, dtype=torch.float32, device=HOST)
    held = torch.zeros(share.num_tokens, dtype=torch.bool, device=HOST)
    gae_algo = adv.monte_carlo_config() if monte_carlo else algo
    cp_group = None if critic is None else critic.groups.parallel.cp

    def where(mb: MicroBatch, mb_ids: list[int]) -> slice | torch.Tensor:
        """This rank's positions of ``mb``'s response tokens in the local buffers."""
        if cp > 1:
            return mb.fields[LOCAL_INDEX].reshape(-1)[mb.response_mask.reshape(-1)]
        if not mb_ids:
            return slice(0, 0)
        last = mb_ids[-1]
        return slice(share.start[mb_ids[0]], share.start[last] + int(lengths[last]))

    for chunk, chunk_ids in _chunks(samples, ids, lead, token_budget, names):
        spans, first = [], 0
        for mb in chunk:
            spans.append(where(mb, chunk_ids[first : first + mb.num_seqs]))
            first += mb.num_seqs
        for name, engine, fn, key in outputs:
            results = engine.run(chunk, fn, forward_only=True)
            if not results:  # not the last pipeline stage: no outputs, no loss here
                continue
            values = [r[key] for r in results]
            for mb, value, span in zip(chunk, values, spans, strict=True):
                mask = mb.response_mask.reshape(-1)
                arrays[name][span] = value.reshape(-1).to(HOST, torch.float32)[mask]
                held[span] = True
            if engine is critic and cp > 1:  # GAE on the CP shards
                advantages, returns, _ = adv.gae_on_cp_shards(
                    gae_algo, chunk, values, torch.tensor(chunk_ids, dtype=torch.long, device=HOST),
                    inputs.rewards, offsets, cp_group,
                )  # fmt: skip
                for mb, a, r, span in zip(chunk, advantages, returns, spans, strict=True):
                    mask = mb.response_mask.reshape(-1)
                    arrays["returns"][span] = r.to(HOST)[mask]
                    if "advantages" in arrays:
                        arrays["advantages"][span] = a.to(HOST)[mask]
    if critic is not None and cp == 1 and not critic.is_last_stage:
        for name in ("returns", "advantages")[: 1 if monte_carlo else 2]:  # read by no loss here
            arrays[name] = torch.zeros(share.num_tokens, dtype=torch.float32, device=HOST)
    if critic is not None and cp == 1 and critic.is_last_stage:
        # Whole sequences on this rank: one packed scan over its samples' response tokens.
        local_offsets = torch.nn.functional.pad(lengths[share.ids].cumsum(0), (1, 0))
        rewards = inputs.rewards[share.ids]
        if monte_carlo:
            arrays["returns"] = adv.monte_carlo_returns(
                rewards, arrays["old_values"], local_offsets
            )
        else:
            arrays["advantages"], arrays["returns"], _ = adv.gae_advantages(
                algo, rewards, arrays["old_values"], local_offsets
            )
    if critic is None and policy is not None:  # the group estimator: a number per sample
        per_sample = group_normalized_advantages(
            inputs.rewards.to(torch.float32), algo.samples_per_prompt,
            scale_by_std=algo.group_scale_by_std,
        )  # fmt: skip
        arrays["advantages"] = torch.repeat_interleave(
            per_sample[share.ids], lengths[share.ids], output_size=share.num_tokens
        )

    # Each token counts once: on its CP rank, at the last stage's first TP rank.
    counting = held if lead.is_last_stage and lead.tp_rank == 0 else torch.zeros_like(held)
    num_counted = int(counting.sum())
    sums = TokenSums(None if num_counted == counting.numel() else counting, host_group)
    total = int(offsets[-1])
    covered = int(sums.total([torch.tensor(num_counted, dtype=torch.float64, device=HOST)])[0])
    if covered != total:
        raise RuntimeError(
            f"the shard path's scoring covered {covered} of {total} response tokens (layout "
            f"{lead.layout}): every token must be scored once"
        )
    metrics: dict[str, float] = {}
    if policy is not None and inputs.rollout_logprobs is not None:
        gap = _logprob_gap_sum(
            inputs.rollout_logprobs, arrays["old_logprobs"], share, offsets, sums
        )
        (gap_sum,) = sums.total([gap])
        metrics["rollout/logprob_gap"] = gap_sum.item() / total
    if critic is not None and not monte_carlo:
        lam_policy, _ = gae_lambdas(algo, lengths)
        metrics.update(lambda_metrics(lam_policy))
    if "advantages" in arrays and whiten:
        mean, std = sums.mean_std(arrays["advantages"])
        arrays["advantages"] = (arrays["advantages"] - mean) / (std + 1e-8)
    if critic is not None:
        metrics.update(critic_metrics(sums, arrays["returns"], arrays["old_values"], total))
    if "advantages" in arrays:
        mean, std = sums.mean_std(arrays["advantages"])
        metrics["advantages/mean"] = mean
        metrics["advantages/std"] = std
    return TokenFields(share.start, arrays), metrics


def _chunks(
    samples: list[Sample],
    ids: list[int],
    engine: ModelEngine,
    token_budget: int,
    names: list[str],
) -> Iterator[tuple[list[MicroBatch], list[int]]]:
    """(micro-batches, their sample ids) a few at a time; one chunk under a pipeline (its
    schedule wants every micro-batch of the pass at once)."""
    if not samples:
        yield [empty_micro_batch(engine.layout, cp_rank=engine.cp_rank, field_names=names)], []
        return
    plan = plan_micro_batches(samples, engine.layout, token_budget=token_budget)
    size = len(plan.groups) if engine.layout.pp > 1 else SCORING_CHUNK
    done = 0
    for first in range(0, len(plan.groups), size):
        groups = plan.groups[first : first + size]
        count = sum(len(g) for g in groups)
        yield [plan.pack(g, engine.cp_rank) for g in groups], ids[done : done + count]
        done += count


def _logprob_gap_sum(
    rollout: torch.Tensor,
    old_logprobs: torch.Tensor,
    share: StepShare,
    offsets: torch.Tensor,
    sums: TokenSums,
) -> torch.Tensor:
    """float64 sum of |exp(rollout - old) - 1| over this rank's counted tokens, in blocks of
    about ``STAT_BLOCK`` tokens (the rollout log-probs come from the step's flat buffer)."""
    total = torch.zeros((), dtype=torch.float64, device=HOST)
    ids = share.ids.tolist()
    flat = offsets.tolist()
    block, first, used = [], 0, 0
    for k, i in enumerate(ids):  # blocks of whole samples: their slices laid end to end
        block.append(rollout[flat[i] : flat[i + 1]])
        used += flat[i + 1] - flat[i]
        if used < STAT_BLOCK and k + 1 < len(ids):
            continue
        span = slice(share.start[ids[first]], share.start[ids[first]] + used)
        gap = torch.cat(block).sub_(old_logprobs[span]).exp_().sub_(1).abs_()
        if sums.counting is not None:
            gap = gap[sums.counting[span]]
        total += gap.sum(dtype=torch.float64)
        block, first, used = [], k + 1, 0
    return total


class TokenSums:
    """float64 sums over the tokens ``counting`` marks on this rank (None: all), all-reduced
    over ``group`` (None: this rank holds every token). Every rank gets the same totals."""

    def __init__(self, counting: torch.Tensor | None, group: dist.ProcessGroup | None):
        self.counting, self.group = counting, group

    def pick(self, x: torch.Tensor) -> torch.Tensor:
        """The counted tokens of ``x`` (all of them without a ``counting`` mask)."""
        return x if self.counting is None else x[self.counting]

    def total(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        out = torch.stack([p.to(HOST, torch.float64) for p in parts])
        if self.group is not None:
            collectives.all_reduce(out, self.group)
        return out

    def mean_std(self, x: torch.Tensor) -> tuple[float, float]:
        """Mean and unbiased std of ``x`` over the counted tokens (two passes, float64)."""
        picked = self.pick(x)
        n, s = self.total(
            [
                torch.tensor(picked.numel(), dtype=torch.float64, device=HOST),
                picked.sum(dtype=torch.float64),
            ]
        )
        count = int(n)
        if count == 0:
            return 0.0, 0.0
        mean = s.item() / count
        squares = torch.zeros((), dtype=torch.float64, device=HOST)
        for block in picked.split(STAT_BLOCK):
            squares += (block.double() - mean).square().sum()
        (squares,) = self.total([squares])
        return mean, math.sqrt(squares.item() / (count - 1)) if count > 1 else 0.0


def lambda_metrics(lam_policy: torch.Tensor) -> dict[str, float]:
    return {
        "lambda_policy/mean": lam_policy.double().mean().item(),
        "lambda_policy/min": lam_policy.min().item(),
        "lambda_policy/max": lam_policy.max().item(),
    }


def critic_metrics(
    sums: TokenSums, returns: torch.Tensor, values: torch.Tensor, total: int
) -> dict[str, float]:
    """Explained variance and the means of values and returns over the step's tokens: the
    sums of ``explained_variance_stats`` in float64, in blocks (no float64 copy of the whole
    buffer)."""
    r, v = sums.pick(returns), sums.pick(values)
    stats = torch.zeros(5, dtype=torch.float64, device=HOST)
    for rb, vb in zip(r.split(STAT_BLOCK), v.split(STAT_BLOCK), strict=True):
        r64 = rb.double()
        e64 = r64 - vb  # R - V in float64 (the values promote): no float32 rounding
        stats += torch.stack(
            [torch.tensor(float(rb.numel()), dtype=torch.float64, device=HOST), r64.sum(),
             r64.dot(r64), e64.sum(), e64.dot(e64)]
        )  # fmt: skip
    totals = sums.total(list(stats))
    r_sum, e_sum = totals[1].item(), totals[3].item()
    return {
        "critic/explained_variance": explained_variance(totals).item(),
        "critic/values_mean": (r_sum - e_sum) / total,  # sum V = sum R - sum (R - V)
        "critic/returns_mean": r_sum / total,
    }
