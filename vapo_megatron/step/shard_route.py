"""The shard route: each data-parallel rank scores, runs GAE on and trains on its own
samples, and no per-token output crosses ranks.

When the policy and the critic split the ranks the same way (one layout), data-parallel rank d
of both models holds the same samples for the whole step: it scores them with both models,
runs decoupled GAE on the critic's context-parallel shards where the values came out
(``advantages.gae_on_cp_shards``: one carry per sequence crosses CP ranks), and trains
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

The flat route (``step/flat_route.py``: every token's outputs gathered to every rank, GAE over
the whole step) remains where the layouts differ, and under CP with a pipeline (a pipeline pads
every row to one length, which moves the last sequence's CP chunks). ``scoring.choose_path``
decides, and says why; ``step/advantages.py`` computes the rest from the held tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.data.packing import MicroBatch, Sample
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.step.advantages import gae_on_cp_shards, monte_carlo_config
from vapo_megatron.step.batching import (
    FLAT_INDEX,
    LOCAL_INDEX,
    build_samples,
    dp_owners,
    empty_micro_batch,
    plan_micro_batches,
)
from vapo_megatron.step.scoring import Scored, StepInputs, StepModels
from vapo_megatron.step.token_sums import HeldTokens, TokenSums
from vapo_megatron.trainer.model_engine import ModelEngine

SCORING_CHUNK = 16
"""Micro-batches packed and scored at a time on the shard route (without a pipeline): the
host holds a chunk's packed rows, not the whole share's."""


@dataclass
class StepShare(HeldTokens):
    """The samples data-parallel rank ``dp_rank`` owns for the whole step (and holds: ``ids``,
    ``start`` and ``num_tokens`` are its local buffers')."""

    owners: list[int]
    """[S] the DP rank of each sample."""

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
    return StepShare(ids=ids, start=starts.tolist(), num_tokens=int(lengths.sum()), owners=owners)


class ShardRoute:
    """Each data-parallel rank scores, holds and trains on its ``share`` of the step."""

    name = "shards"
    packs_once = True

    def __init__(self, share: StepShare, host_group: dist.ProcessGroup | None) -> None:
        self.share, self.host_group = share, host_group

    def mine(self, engine: ModelEngine, chosen: Sequence[int]) -> list[int]:
        return self.share.mine(chosen, engine.dp_rank)

    def score(
        self,
        models: StepModels,
        inputs: StepInputs,
        *,
        algo: AlgoConfig,
        monte_carlo: bool,
        token_budget: int,
    ) -> Scored:
        """The passes on this rank's samples, a few micro-batches at a time; under CP, GAE
        (``algo``; ``monte_carlo``: the Monte-Carlo returns, no advantages) on the critic's
        shards as they come out. Collective over the models' groups and the host group."""
        share, critic = self.share, models.critic
        lead = models.scorers()[-1]
        cp = lead.layout.cp
        arrays = _buffers(models, share.num_tokens, monte_carlo=monte_carlo)
        held = torch.zeros(share.num_tokens, dtype=torch.bool, device=HOST)
        passes = []
        if models.policy is not None:
            passes.append(("old_logprobs", models.policy, models.logprob_fn, "logprobs"))
        if critic is not None:
            passes.append(("old_values", critic, models.value_fn, "values"))
        gae_algo = monte_carlo_config() if monte_carlo else algo
        ids = share.ids.tolist()
        for chunk, chunk_ids in _chunks(self._samples(inputs, cp), ids, lead, token_budget, cp):
            spans = self._spans(chunk, chunk_ids, cp, inputs.responses.offsets.diff())
            for name, engine, fn, key in passes:
                results = engine.run(chunk, fn, forward_only=True)
                if not results:  # not the last pipeline stage: no outputs, no loss here
                    continue
                values = [r[key] for r in results]
                _write(arrays[name], held, chunk, values, spans)
                if engine is critic and cp > 1:  # GAE on the CP shards
                    advantages, returns, _ = gae_on_cp_shards(
                        gae_algo, chunk, values,
                        torch.tensor(chunk_ids, dtype=torch.long, device=HOST),
                        inputs.rewards, inputs.responses.offsets, critic.groups.parallel.cp,
                    )  # fmt: skip
                    _write(arrays["returns"], None, chunk, returns, spans)
                    if "advantages" in arrays:
                        _write(arrays["advantages"], None, chunk, advantages, spans)
        sums = self._counting_sums(held, lead, total=int(inputs.responses.offsets[-1]))
        whole = critic is not None and cp == 1 and critic.is_last_stage
        return Scored(share, arrays, sums, whole_sequences=whole)

    def _samples(self, inputs: StepInputs, cp: int) -> list[Sample]:
        """This rank's samples; under CP each carries its tokens' positions in the local
        buffers. Without CP a micro-batch's response tokens, in order, are one contiguous
        span of the local buffers (its samples are consecutive samples of this rank): a
        slice, not an index."""
        share = self.share

        def local_index(i: int, flat: slice) -> dict[str, torch.Tensor]:
            start = share.start[i]
            return {
                LOCAL_INDEX: torch.arange(
                    start, start + flat.stop - flat.start, dtype=torch.long, device=HOST
                )
            }

        return build_samples(
            inputs.prompts, inputs.responses, share.ids.tolist(), inputs.responses.offsets,
            local_index if cp > 1 else None, flat_index=cp > 1,
        )  # fmt: skip

    def _spans(
        self, chunk: list[MicroBatch], chunk_ids: list[int], cp: int, lengths: torch.Tensor
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
                spans.append(
                    slice(self.share.start[mb_ids[0]], self.share.start[last] + int(lengths[last]))
                )
        return spans

    def _counting_sums(self, held: torch.Tensor, lead: ModelEngine, *, total: int) -> TokenSums:
        """Sums where each token counts once: on its CP rank, at the last stage's first TP
        rank; checks that the scoring covered each of the step's ``total`` tokens."""
        counting = held if lead.is_last_stage and lead.tp_rank == 0 else torch.zeros_like(held)
        num_counted = int(counting.sum())
        sums = TokenSums(None if num_counted == counting.numel() else counting, self.host_group)
        covered = int(sums.total([torch.tensor(num_counted, dtype=torch.float64, device=HOST)])[0])
        if covered != total:
            raise RuntimeError(
                f"the shard path's scoring covered {covered} of {total} response tokens (layout "
                f"{lead.layout}): every token must be scored once"
            )
        return sums


def _buffers(models: StepModels, num_tokens: int, *, monte_carlo: bool) -> dict[str, torch.Tensor]:
    """This rank's zeroed per-token buffers: the scoring outputs, and the returns (and
    advantages) where the tail's packed scan will not fill them (filled shard by shard under
    CP; read by no loss on a stage without outputs)."""
    names = []
    if models.policy is not None:
        names.append("old_logprobs")
    critic = models.critic
    if critic is not None:
        names.append("old_values")
        if critic.layout.cp > 1 or not critic.is_last_stage:
            names += ["returns"] if monte_carlo else ["returns", "advantages"]
    return {name: torch.zeros(num_tokens, dtype=torch.float32, device=HOST) for name in names}


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
        mask = mb.response_mask.reshape(-1)
        buffer[span] = value.reshape(-1).to(HOST, torch.float32)[mask]
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
    schedule wants every micro-batch of the pass at once)."""
    names = [FLAT_INDEX, LOCAL_INDEX] if cp > 1 else []
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
