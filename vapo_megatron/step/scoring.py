"""Step 5, the scoring pass (no grad), and the two routes by which its per-token outputs
reach the rank that trains on them.

The policy gives each response token's old log-prob, the critic its value. A route
(``OutputRoute``) runs the passes and leaves this rank holding some samples' outputs
(``HeldTokens``) with the sums that count each token once over the job (``TokenSums``):

- the shard route (``step/shard_route.py``, where the models that score the step share one
  layout): data-parallel rank d scores, keeps and trains on its own samples for the whole
  step; nothing per token crosses ranks;
- the flat route (``step/flat_route.py``, where the layouts differ, or CP with PP): every
  token's outputs gathered to every rank by ``flat_index``; each rank holds the whole step.

Everything after scoring (GAE, returns, group advantages, whitening, the statistics) is
written once, over the held tokens (``step/advantages.py``). ``choose_path`` decides the
route, and says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.step.batching import Ragged
from vapo_megatron.step.token_sums import HeldTokens, TokenSums
from vapo_megatron.trainer.model_engine import LossFn, ModelEngine

GAE_PATHS = ("auto", "shards", "flat")


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
class StepInputs:
    """What the scoring pass and the advantages read of the step (all on the host)."""

    prompts: Ragged
    responses: Ragged
    rewards: torch.Tensor
    """[S] per-sample rewards."""
    rollout_logprobs: torch.Tensor | None
    """[N] the engine's log-probs in flat order (for the gap metric), or None."""


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
class Scored:
    """A route's scoring outputs on this rank."""

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


class OutputRoute(Protocol):
    """How the scoring passes' per-token outputs reach the ranks that train on them."""

    name: str
    """"shards" or "flat" (trainer.gae_path)."""
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
