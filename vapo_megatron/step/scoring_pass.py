"""Each model scores its own share of the step: the samples its data-parallel rank owns for
the whole step (``StepShare``), scored a few micro-batches at a time into local buffers of
those samples' response tokens.

A model's DP rank d owns the samples ``step_share`` gives it: the first epoch's mini-batches,
each split by token counts (``batching.dp_owners`` over the model's DP size), so the first
epoch trains every rank on the same micro-batches as a split of each mini-batch would. Later
epochs keep the owners: each mini-batch's update is the same sum over its samples, only its
split over ranks (the float order, the balance) differs. Two models of one DP size own the
same samples.

``score_share`` runs one or both scoring passes over a share (both when the two models share
one layout: packed once for both) and leaves a ``Side``: the per-token outputs in local
buffers (this DP rank's samples' response tokens end to end, at this CP rank's positions;
the rest 0), and the sums that count each token once over the job. Under CP:

- without a pipeline each sequence is padded on its own (``batching.MicroBatchPlan``), so its
  CP chunks are the same in every micro-batch it lands in: the buffers keep this CP rank's
  chunks only, and the critic's values go as they come out to the caller's ``shard_gae``
  (``advantages.CriticShardGae``: GAE on the shards, one carry per sequence across CP ranks);
- with a pipeline every row is padded to one length, which moves a row's last sequence's
  chunks between the scoring pass and an update's micro-batches: the CP ranks' chunks are
  reassembled (one sum over the model's CP group on its device: each position is held by
  exactly one CP rank, the others add 0) and GAE scans whole sequences.

``step/advantage_exchange.py`` composes the sides and moves the critic's advantages to the
policy's owners where the two models' shares differ.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from vapo_megatron.algorithms.masks import count_true
from vapo_megatron.data.packing import MicroBatch, Sample
from vapo_megatron.engine.model_engine import LossFn, ModelEngine
from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.step.batching import (
    FLAT_INDEX,
    LOCAL_INDEX,
    agreed_count,
    build_samples,
    dp_owners,
    pad_micro_batches,
    plan_micro_batches,
)
from vapo_megatron.step.critic_routes import keep_sample_routes, whole_rows
from vapo_megatron.step.outputs import Side, StepInputs
from vapo_megatron.step.token_sums import HeldTokens, TokenSums


class ShardGae(Protocol):
    """Takes the critic's values on its CP shards, chunk by chunk, as the scoring pass makes
    them (``step/advantages.py::CriticShardGae``)."""

    names: list[str]
    """The per-token outputs it gives, each kept in a local buffer like the passes' own."""

    def __call__(
        self,
        micro_batches: Sequence[MicroBatch],
        sample_ids: Sequence[int],
        values: Sequence[torch.Tensor],
        cp_group: dist.ProcessGroup | None,
        logprobs: Sequence[torch.Tensor] | None = None,
    ) -> dict[str, list[torch.Tensor]]: ...


SCORING_CHUNK = 16
"""Micro-batches packed and scored at a time (without a pipeline): the host holds a chunk's
packed rows, not the whole share's."""


@dataclass
class StepShare(HeldTokens):
    """The samples data-parallel rank ``dp_rank`` of a model owns for the whole step (and
    holds: ``ids``, ``start`` and ``num_tokens`` are its local buffers')."""

    owners: list[int]
    """[S] the DP rank of each sample."""
    owner_start: torch.Tensor
    """[S] int64 each sample's first position in its owner's buffers (every rank knows where
    every sample sits, so a sender names the position at the receiver)."""

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
    owner = torch.tensor(owners, dtype=torch.long, device=HOST)
    owner_start = torch.zeros(len(owners), dtype=torch.long, device=HOST)
    for rank in range(dp_size):
        ids = (owner == rank).nonzero().squeeze(1)
        lengths = response_lengths[ids]
        owner_start[ids] = lengths.cumsum(0) - lengths
    ids = (owner == dp_rank).nonzero().squeeze(1)
    starts = torch.zeros(len(owners), dtype=torch.long, device=HOST)
    starts[ids] = owner_start[ids]
    return StepShare(
        ids=ids, start=starts.tolist(), num_tokens=int(response_lengths[ids].sum()),
        owners=owners, owner_start=owner_start,
    )  # fmt: skip


@dataclass
class ScoringPass:
    """One model's scoring pass: its outputs ``key`` of ``fn`` into the buffer ``name``."""

    name: str
    """"old_logprobs" or "old_values"."""
    engine: ModelEngine
    fn: LossFn
    key: str
    """"logprobs" or "values"."""


def score_share(
    passes: Sequence[ScoringPass],
    share: StepShare,
    inputs: StepInputs,
    *,
    token_budget: int,
    host_group: dist.ProcessGroup | None,
    shard_gae: ShardGae | None = None,
) -> Side:
    """The ``passes`` (models of one layout) on ``share``, a few micro-batches at a time;
    under CP without a pipeline the critic's values go to ``shard_gae`` as they come out
    (required then: the shards are not kept whole) and its outputs are kept beside them;
    under CP with a pipeline, the shards reassembled after. Collective over the models' groups
    and the host group."""
    lead = passes[-1].engine
    layout = lead.layout
    critic = next((p.engine for p in passes if p.name == "old_values"), None)
    shards_gae = critic is not None and layout.cp > 1 and layout.pp == 1
    reassemble = layout.cp > 1 and layout.pp > 1
    whole = lead.is_last_stage and not shards_gae
    # The critic's row-6 outputs get buffers where the tail's packed scan will not fill them:
    # on CP shards (filled chunk by chunk) and on a stage without outputs (read by no loss).
    extra = critic is not None and not whole
    if extra and shard_gae is None:
        raise ValueError(
            "the critic's values are not whole sequences here (CP shards, or a stage without "
            "outputs): pass shard_gae (step/advantages.py::CriticShardGae)"
        )
    arrays = _buffers(passes, share.num_tokens, shard_gae.names if extra else [])
    held = torch.zeros(share.num_tokens, dtype=torch.bool, device=HOST)
    ids = share.ids.tolist()
    samples = _samples(share, inputs, layout.cp)
    # An MoE critic with routing replay keeps its routes for its updates (step/critic_routes.py).
    records = critic is not None and critic.router_replay is not None
    routes: dict[int, torch.Tensor] | None = {} if records else None
    token_counts = (
        (inputs.prompts.lengths() + inputs.responses.lengths()).tolist() if records else []
    )
    for chunk, chunk_ids in _chunks(samples, ids, lead, token_budget, layout.cp):
        spans = _spans(share, chunk, chunk_ids, layout.cp, inputs.responses.offsets.diff())
        chunk_logprobs = None  # the policy's, where one pass scores both models' chunk
        for p in passes:
            record = records and p.engine is critic
            results = p.engine.run(chunk, p.fn, forward_only=True, record_routes=record)
            if record:
                rows = whole_rows(critic, chunk)
                keep_sample_routes(routes, chunk, chunk_ids, rows, token_counts)
            if not results:  # not the last pipeline stage: no outputs, no loss here
                continue
            values = [r[p.key] for r in results]
            _write(arrays[p.name], held, chunk, values, spans)
            if p.name == "old_logprobs":
                chunk_logprobs = values
            if p.engine is critic and shards_gae:  # row 6's GAE on the CP shards
                outputs = shard_gae(
                    chunk, chunk_ids, values, critic.groups.parallel.cp, logprobs=chunk_logprobs
                )
                for name, per_mb in outputs.items():
                    _write(arrays[name], None, chunk, per_mb, spans)
    if reassemble and lead.is_last_stage:
        _reassemble(arrays, held, lead)
    counts_here = lead.is_last_stage and lead.tp_rank == 0 and (lead.cp_rank == 0 or not reassemble)
    sums = _counting_sums(
        held, counts_here, lead, host_group, total=int(inputs.responses.offsets[-1])
    )
    return Side(share, arrays, sums, whole_sequences=whole, held_mask=held, routes=routes)


def _reassemble(arrays: dict[str, torch.Tensor], held: torch.Tensor, engine: ModelEngine) -> None:
    """Whole sequences on every CP rank from each one's chunks: a sum over the model's CP
    group on its device (each response position is written by exactly one CP rank; the
    others hold 0 there, so the sum is exact)."""
    cp_group = engine.groups.parallel.cp
    for buffer in arrays.values():
        on_device = buffer.to(engine.device)
        collectives.all_reduce(on_device, cp_group)
        buffer.copy_(on_device)
    flags = held.to(engine.device, torch.int32)
    collectives.all_reduce(flags, cp_group)
    held.copy_(flags.to(HOST) > 0)


def _buffers(
    passes: Sequence[ScoringPass], num_tokens: int, extra: Sequence[str]
) -> dict[str, torch.Tensor]:
    """Zeroed per-token buffers: the passes' outputs, and ``extra`` ones (the critic's returns
    and advantages: filled shard by shard under CP, read by no loss on a stage without
    outputs)."""
    names = [p.name for p in passes] + list(extra)
    return {name: torch.zeros(num_tokens, dtype=torch.float32, device=HOST) for name in names}


def _samples(share: StepShare, inputs: StepInputs, cp: int) -> list[Sample]:
    """The share's samples; under CP each carries its tokens' positions in the local buffers.
    Without CP a micro-batch's response tokens, in order, are one contiguous span of the
    local buffers (its samples are consecutive samples of the share): a slice, not an index."""

    def local_index(i: int, flat: slice) -> dict[str, torch.Tensor]:
        start = share.start[i]
        return {
            LOCAL_INDEX: torch.arange(
                start, start + flat.stop - flat.start, dtype=torch.long, device=HOST
            )
        }

    return build_samples(
        inputs.prompts, inputs.responses, share.ids.tolist(), inputs.responses.offsets,
        local_index if cp > 1 else None, flat_index=cp > 1, routes=inputs.routes,
    )  # fmt: skip


def _spans(
    share: StepShare,
    chunk: list[MicroBatch],
    chunk_ids: list[int],
    cp: int,
    lengths: torch.Tensor,
) -> list[slice | torch.Tensor]:
    """Per micro-batch of ``chunk``: this rank's positions of its response tokens in the
    local buffers."""
    spans, first = [], 0
    for mb in chunk:
        mb_ids = chunk_ids[first : first + mb.num_seqs]
        first += mb.num_seqs
        if cp > 1:
            spans.append(mb.fields[LOCAL_INDEX].reshape(-1)[mb.response_mask.reshape(-1)])
        elif not mb_ids:
            spans.append(slice(0, 0))
        else:
            last = mb_ids[-1]
            spans.append(slice(share.start[mb_ids[0]], share.start[last] + int(lengths[last])))
    return spans


def _counting_sums(
    held: torch.Tensor,
    counts_here: bool,
    lead: ModelEngine,
    host_group: dist.ProcessGroup | None,
    *,
    total: int,
) -> TokenSums:
    """Sums where each token counts once (``counts_here``: on its CP rank, or CP rank 0 once
    reassembled, at the last stage's first TP rank); checks that the scoring covered each of
    the step's ``total`` tokens."""
    counting = held if counts_here else torch.zeros_like(held)
    num_counted = count_true(counting)
    sums = TokenSums(None if num_counted == counting.numel() else counting, host_group)
    covered = int(sums.total([torch.tensor(num_counted, dtype=torch.float64, device=HOST)])[0])
    if covered != total:
        raise RuntimeError(
            f"the scoring pass covered {covered} of {total} response tokens (layout "
            f"{lead.layout}): every token must be scored once"
        )
    return sums


def _write(
    buffer: torch.Tensor,
    held: torch.Tensor | None,
    chunk: list[MicroBatch],
    outputs: Sequence[torch.Tensor],
    spans: Sequence[slice | torch.Tensor],
) -> None:
    """Each micro-batch's outputs on its response tokens into ``buffer`` at its ``spans``
    (and marks them in ``held``)."""
    for mb, value, span in zip(chunk, outputs, spans, strict=True):
        value = value.reshape(-1).to(HOST, torch.float32)
        runs = mb.response_runs
        if runs is not None and isinstance(span, slice):
            # The response positions as the row's runs, by one cat of slices into the span:
            # a few calls, where a masked select reads every position (~6 ns a token).
            count = sum(n for _, n in runs)
            if count != span.stop - span.start:
                raise RuntimeError(
                    f"a micro-batch has {count} response tokens for a span of "
                    f"{span.stop - span.start} in the step's buffers"
                )
            if runs:  # none: an empty micro-batch
                torch.cat([value[a : a + n] for a, n in runs], out=buffer[span])
        else:  # masked_select: the same elements as boolean indexing, ~2x faster
            buffer[span] = torch.masked_select(value, mb.response_mask.reshape(-1))
        if held is not None:
            held[span] = True


def _chunks(
    samples: list[Sample],
    ids: list[int],
    engine: ModelEngine,
    token_budget: int,
    cp: int,
) -> Iterator[tuple[list[MicroBatch], list[int]]]:
    """(micro-batches, their sample ids) a few at a time; one chunk under a pipeline (its
    schedule wants every micro-batch of the pass at once). A model that runs in lockstep
    (``batching.runs_in_lockstep``: EP > 1) pads to as many micro-batches as any DP rank packs
    (``agreed_count``, over the host group), so chunk k has the same count on every rank."""
    names = [FLAT_INDEX, LOCAL_INDEX] if cp > 1 else []
    layout = engine.layout
    plan = plan_micro_batches(samples, layout, token_budget=token_budget) if samples else None
    groups = plan.groups if plan is not None else []
    total = agreed_count(max(len(groups), 1), layout, engine.groups.host)
    size = total if layout.pp > 1 else SCORING_CHUNK
    done = 0
    for first in range(0, total, size):
        chunk = groups[first : first + size]
        count = sum(len(g) for g in chunk)
        mbs = plan.pack(chunk, engine.cp_rank) if chunk else []
        padded = pad_micro_batches(
            mbs, min(size, total - first), layout, cp_rank=engine.cp_rank, field_names=names
        )
        yield padded, ids[done : done + count]
        done += count
