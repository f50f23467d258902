"""The flat route: every token's scoring outputs gathered to every rank.

Each data-parallel rank of a model scores its share of the samples; the last pipeline
stage's first tensor-parallel rank of each (data, context) rank then holds its tokens'
outputs, keyed by their ``flat_index``. One gather over the world puts every token's output
into the step's flat buffer on every rank, whatever the model's layout, so the policy and
the critic may be split differently (and CP may run with PP). Every rank then holds the whole
step (the shard route's tail with the whole step as the share), and each model's
data-parallel rank trains on its share of each mini-batch by token counts (``dp_share``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.parallel.collectives import all_gather_varlen
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.step.batching import (
    FLAT_INDEX,
    Ragged,
    build_samples,
    dp_share,
    micro_batches,
    response_offsets,
    row_lengths,
)
from vapo_megatron.step.scoring import Scored, StepInputs, StepModels
from vapo_megatron.step.token_sums import HeldTokens, TokenSums
from vapo_megatron.trainer.model_engine import LossFn, ModelEngine


class FlatRoute:
    """Every rank holds every token's outputs; a model's data-parallel rank trains on its
    share of each mini-batch by token counts. ``token_counts``: [S] prompt + response tokens
    of each sample; ``response_offsets``: [S + 1]."""

    name = "flat"
    packs_once = False

    def __init__(self, token_counts: list[int], response_offsets: torch.Tensor) -> None:
        self.token_counts = token_counts
        num_samples = len(token_counts)
        self.held = HeldTokens(
            ids=torch.arange(num_samples, dtype=torch.long, device=HOST),
            start=response_offsets[:-1].tolist(),
            num_tokens=int(response_offsets[-1]),
        )

    def score(
        self,
        models: StepModels,
        inputs: StepInputs,
        *,
        algo: AlgoConfig,
        monte_carlo: bool,
        token_budget: int,
    ) -> Scored:
        """Both passes, each gathered to every rank (``score_flat``); GAE comes after, over
        the whole step (``algo`` and ``monte_carlo`` are the tail's)."""
        arrays: dict[str, torch.Tensor] = {}
        if models.policy is not None:
            arrays["old_logprobs"] = score_flat(
                models.policy, inputs.prompts, inputs.responses, output_key="logprobs",
                token_budget=token_budget, scoring_fn=models.logprob_fn,
            )  # fmt: skip
        if models.critic is not None:
            # Temperature is the policy's; the critic's values are never divided by it.
            arrays["old_values"] = score_flat(
                models.critic, inputs.prompts, inputs.responses, output_key="values",
                token_budget=token_budget, scoring_fn=models.value_fn,
            )  # fmt: skip
        return Scored(self.held, arrays, TokenSums(None, None), whole_sequences=True)

    def mine(self, engine: ModelEngine, chosen: Sequence[int]) -> list[int]:
        share = dp_share([self.token_counts[i] for i in chosen], engine.dp_size, engine.dp_rank)
        return [chosen[k] for k in share]


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
    flat order (sample by sample, token by token), on every rank. ``prompts`` and
    ``responses``: one row of token ids per sample (lists, or ``Ragged`` flat buffers)."""
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
    outputs = engine.run(mbs, scoring_fn, forward_only=True)
    # Gathered on the model's device over the world group (NCCL on GPU); the step's flat
    # buffer is host bookkeeping, so the result comes back to the host once.
    device = engine.device
    index_parts, value_parts = [], []
    # int32 positions halve the gather's index bytes (a 32B step has ~44M response tokens)
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
    index = all_gather_varlen(index, world).to(HOST)
    value = all_gather_varlen(value, world).to(HOST)
    seen = torch.zeros(total, dtype=torch.bool, device=HOST)
    seen[index] = True  # with index.numel() == total, all seen <=> each token exactly once
    if index.numel() != total or not bool(seen.all()):
        raise RuntimeError(
            f"scoring pass covered {index.numel()} of {total} response tokens on rank "
            f"{dist.get_rank()} (layout {engine.layout}): every token must be scored once"
        )
    flat = torch.zeros(total, dtype=torch.float32, device=HOST)
    flat[index] = value
    return flat
