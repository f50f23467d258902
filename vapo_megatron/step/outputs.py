"""What step 5 (the scoring pass, no grad: ``step/scoring_pass.py``) leaves behind, and the
data path by which its per-token outputs reach the ranks that train on them: the interface
types (``StepInputs``, ``StepModels``, ``Side``, ``Scored``, ``TokenFields``, ``OutputPath``),
the path's choice (``choose_path``) and a whole-batch reference scorer for checks
(``score_flat``).

The policy gives each response token's old log-prob, the critic its value. Each model's
data-parallel rank owns samples for the whole step (the first epoch's mini-batches, each split
by token counts over that model's DP size: ``scoring_pass.step_share``) and scores, keeps and
trains on them. GAE runs where the values are, on the critic's owners (``step/advantages.py``):
the critic's targets (returns) stay there; the policy's advantages go to the policy's owners,
which differ only where the two models split the ranks differently
(``step/advantage_exchange.py``: one all-to-all over the host group). Where both models share one
layout (``choose_path`` says "shards") the owners coincide and nothing per token crosses
ranks; otherwise ("routed") only the advantages do, each to the ranks that train on its sample.

An ``OutputPath`` (``step/advantage_exchange.py::OwnerPath``) runs the passes and leaves this rank a ``Scored``: per model a
``Side`` (the held samples' outputs and the sums that count each token once over the job),
and the hand-over of the critic's per-token arrays to the policy's side.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.algorithms.masks import all_true
from vapo_megatron.engine.model_engine import LossFn, ModelEngine
from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.step.batching import (
    FLAT_INDEX,
    Ragged,
    build_samples,
    dp_share,
    line_up,
    micro_batches,
    response_offsets,
    row_lengths,
)
from vapo_megatron.step.importance import StaleTraces
from vapo_megatron.step.token_sums import HeldTokens, TokenSums


@dataclass(frozen=True)
class PathChoice:
    name: str
    """"shards" (one layout: nothing per token crosses ranks) or "routed" (the critic's
    advantages go to the policy's owners)."""
    reason: str


def choose_path(
    engines: Sequence[ModelEngine], *, host_group: dist.ProcessGroup | None
) -> PathChoice:
    """Whether the step's scorers (policy and/or critic) own the same samples at the same
    coordinates on every rank ("shards") or the critic's advantages must be routed to the
    policy's owners ("routed"), and why. Collective over ``host_group`` (every rank takes the
    same path)."""
    lead = engines[0]
    reason = ""
    if any(e.layout != lead.layout for e in engines):
        reason = (
            f"the policy's layout {engines[0].layout} and the critic's {engines[-1].layout} differ"
        )
    elif any(_coordinates(e) != _coordinates(lead) for e in engines):
        reason = "the models place this rank at different (tp, pp, cp, dp) coordinates"
    agree = torch.tensor([0 if reason else 1], dtype=torch.int64, device=HOST)
    collectives.all_reduce(agree, host_group, op=dist.ReduceOp.MIN)
    if not reason and not bool(agree):
        reason = "another rank's models sit at different coordinates"
    if reason:
        return PathChoice(
            "routed",
            f"{reason}: each model scores and trains on its own DP ranks' samples (policy "
            f"dp={engines[0].dp_size}, critic dp={engines[-1].dp_size}), GAE runs on the "
            "critic's, and each token's advantage goes to the policy's rank that trains on it",
        )
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
    each sample's tokens start in them: a model's DP rank's samples end to end."""

    start: list[int]
    """Per sample of the step: its first token's position in the arrays (only the samples
    this rank holds are valid)."""
    arrays: dict[str, torch.Tensor]
    starts: dict[str, list[int]] = field(default_factory=dict)
    """Per array name, its own ``start`` where it differs (the policy's arrays sit in the
    policy's owners' buffers, the critic's in the critic's)."""

    def of(self, name: str, i: int, length: int) -> torch.Tensor:
        """Array ``name`` over sample ``i``'s ``length`` response tokens."""
        start = self.starts.get(name, self.start)[i]
        return self.arrays[name][start : start + length]


@dataclass
class StepInputs:
    """What the scoring pass and the advantages read of the step (all on the host)."""

    prompts: Ragged
    responses: Ragged
    rewards: torch.Tensor
    """[S] per-sample rewards."""
    rollout_logprobs: torch.Tensor | None
    """[N] the engine's log-probs in flat order (for the gap metric), or None."""
    routes: tuple[torch.Tensor, torch.Tensor] | None = None
    """Routing replay: the engine's routes [T, layers, top_k] of this rank's policy samples
    and their offsets [S + 1] (``step/engine_routes.py``), packed with the scoring micro-batches
    (``batching.build_samples(routes=)``); None: off."""
    traces: StaleTraces | None = None
    """Stale samples' importance traces for V-trace GAE (``step/importance.py``); None: GAE
    as without lag."""


@dataclass
class StepModels:
    """The models that score and train on the step, and their scoring functions."""

    policy: ModelEngine | None
    """Gives old_logprobs (with ``logprob_fn``); None in critic pretraining."""
    critic: ModelEngine | None
    """Gives old_values (with ``value_fn``); None without a critic."""
    logprob_fn: LossFn | None = None
    value_fn: LossFn | None = None

    def scorers(self) -> list[ModelEngine]:
        """The models that score this step, the policy first."""
        return [e for e in (self.policy, self.critic) if e is not None]


@dataclass
class Side:
    """One model's (or both models', on one layout) scoring outputs on this rank."""

    held: HeldTokens
    """The samples whose tokens the arrays cover."""
    arrays: dict[str, torch.Tensor]
    """[held.num_tokens] float32 old_logprobs and/or old_values; returns (and advantages) too
    where GAE already ran on the critic's CP shards (or zeros: a stage that holds no output)."""
    sums: TokenSums
    """Sums over the held tokens this rank counts (each token once over the job)."""
    whole_sequences: bool
    """The held values are whole sequences here, for GAE to scan (False: it ran on the CP
    shards during scoring, or this pipeline stage holds no outputs)."""
    held_mask: torch.Tensor | None = None
    """[held.num_tokens] bool: the positions this rank's scoring wrote (its CP chunks)."""
    routes: dict[int, torch.Tensor] | None = None
    """An MoE critic with routing replay: its held samples' routes from this pass, by sample
    ([prompt + response, layers, top_k] int16; ``step/critic_routes.py``); None: none kept."""


@dataclass
class Scored:
    """A path's scoring outputs on this rank."""

    policy: Side | None
    """The policy's old log-probs on its owners' samples (None in critic pretraining)."""
    critic: Side | None
    """The critic's values on its owners' samples (None without a critic); the same object
    as ``policy`` where both share one layout."""
    to_policy: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
    """A per-token array of the critic's side -> the same tokens on the policy's side (the
    advantages; collective over the host group). The identity on one layout."""


class OutputPath(Protocol):
    """How the scoring passes' per-token outputs reach the ranks that train on them."""

    name: str
    """"shards" or "routed" (``choose_path``)."""
    packs_once: bool
    """Both models train on the same samples of one layout: pack once for both."""

    def score(
        self,
        models: StepModels,
        inputs: StepInputs,
        *,
        algo: AlgoConfig,
        monte_carlo: bool,
        token_budget: int,
    ) -> Scored:
        """Run the scoring passes (collective over the models' groups)."""
        ...

    def mine(self, engine: ModelEngine, chosen: Sequence[int]) -> list[int]:
        """The samples of mini-batch ``chosen`` that ``engine``'s data-parallel rank trains on
        (whose fields this rank holds), in ``chosen``'s order."""
        ...


def score_flat(
    engine: ModelEngine,
    prompts: Sequence[list[int]] | Ragged,
    responses: Sequence[list[int]] | Ragged,
    *,
    scoring_fn: LossFn,
    output_key: str,
    token_budget: int,
) -> torch.Tensor:
    """``output_key`` of ``scoring_fn`` for every response token of the step: [N] float32 in
    flat order (sample by sample, token by token), on every rank. A reference for checks and
    tests (the GPU checks, the packing tests): the step itself never gathers every token to
    every rank. ``prompts`` and ``responses``: one row of token ids per sample (lists, or
    ``Ragged`` flat buffers)."""
    response_lengths = row_lengths(responses)
    offsets = response_offsets(response_lengths)
    total = int(offsets[-1])
    token_counts = [p + r for p, r in zip(row_lengths(prompts), response_lengths, strict=True)]
    mine = dp_share(token_counts, engine.dp_size, engine.dp_rank)
    samples = build_samples(prompts, responses, mine, offsets)
    mbs = micro_batches(
        samples, engine.layout, cp_rank=engine.cp_rank, token_budget=token_budget,
        field_names=[FLAT_INDEX],
    )  # fmt: skip
    # As many micro-batches on every DP rank where the model runs in lockstep (EP > 1).
    mbs = line_up(
        mbs, engine.layout, cp_rank=engine.cp_rank, field_names=[FLAT_INDEX],
        host_group=engine.groups.host,
    )  # fmt: skip
    outputs = engine.run(mbs, scoring_fn, forward_only=True)
    # Gathered on the model's device over the world group (NCCL on GPU), back to the host once.
    device = engine.device
    index_parts, value_parts = [], []
    index_dtype = torch.int32 if total < 2**31 else torch.long
    if engine.is_last_stage and engine.tp_rank == 0:
        for mb, out in zip(mbs, outputs, strict=True):
            mask = mb.response_mask.to(device)
            index_parts.append(mb.fields[FLAT_INDEX].to(device)[mask].to(index_dtype))
            value_parts.append(out[output_key][mask].to(torch.float32))
    index = (
        torch.cat(index_parts) if index_parts else torch.zeros(0, dtype=index_dtype, device=device)
    )
    value = torch.cat(value_parts) if value_parts else torch.zeros(0, device=device)
    world = engine.groups.world
    index = collectives.all_gather_varlen(index, world).to(HOST)
    value = collectives.all_gather_varlen(value, world).to(HOST)
    seen = torch.zeros(total, dtype=torch.bool, device=HOST)
    seen[index] = True  # with index.numel() == total, all seen <=> each token exactly once
    if index.numel() != total or not all_true(seen):
        raise RuntimeError(
            f"scoring pass covered {index.numel()} of {total} response tokens on rank "
            f"{dist.get_rank()} (layout {engine.layout}): every token must be scored once"
        )
    flat = torch.zeros(total, dtype=torch.float32, device=HOST)
    flat[index] = value
    return flat
