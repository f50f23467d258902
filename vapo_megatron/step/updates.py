"""Step 7: mini-batch updates, each a gradient step of the critic, then of the policy.

The step's samples are cut into seeded mini-batches per PPO epoch (``minibatch_indices``);
each model's data-parallel rank trains on the samples whose fields it holds
(``OutputPath.mine``). The model's data-parallel rank packs its share; the loss normalisers (response tokens,
sequences, tokens of correct responses) are counted over all its micro-batches and reduced
over the model's data x context group *before* the backward pass, so the update equals the
single-device update of the whole mini-batch for any split (``parallel/reductions.py``).
An MoE model at EP > 1 runs as many micro-batches on each of its DP ranks (empty ones pad the
shorter shares: ``batching.line_up``), since its token dispatcher's collectives span them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.algorithms.rollout_correction import RolloutCorrectionConfig, rollout_weights
from vapo_megatron.data.packing import MicroBatch, Sample
from vapo_megatron.engine.model_engine import LossFn, ModelEngine
from vapo_megatron.parallel.collectives import all_gather_objects, all_reduce
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.parallel.reductions import LossNormalisers, global_loss_normalisers
from vapo_megatron.step.batching import (
    ROUTES,
    Ragged,
    build_samples,
    dp_share,
    line_up,
    micro_batches,
)
from vapo_megatron.step.losses import policy_loss_fn, value_loss_fn
from vapo_megatron.step.outputs import OutputPath, TokenFields
from vapo_megatron.step.timing import Timer

CRITIC_FIELDS = ["returns", "old_values"]
"""Per-token fields the critic's loss reads (``losses.value_loss_fn``)."""
POLICY_FIELDS = ["old_logprobs", "advantages", "positive", "seq_num_tokens"]
"""Per-token fields the policy's loss reads (``losses.policy_loss_fn``)."""
CORRECTION_FIELDS = ["rollout_weight", "rollout_keep"]
"""Per-token fields of the rollout importance correction, when it is on (``rollout_correction``)."""


def minibatch_indices(num_samples: int, num_minibatches: int, seed: int) -> list[torch.Tensor]:
    """A seeded permutation of the step's samples cut into ``num_minibatches`` near-equal parts."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_samples, generator=generator, device=HOST)
    return [part for part in torch.tensor_split(order, num_minibatches) if part.numel()]


def epoch_minibatches(
    num_samples: int, num_minibatches: int, *, seed: int, step: int, epoch: int
) -> list[torch.Tensor]:
    """The mini-batches of PPO epoch ``epoch`` of step ``step`` (trainer.seed ``seed``)."""
    return minibatch_indices(num_samples, num_minibatches, seed * 1_000_003 + step * 101 + epoch)


@dataclass
class UpdateData:
    """What the mini-batch updates read of the step, on every rank."""

    prompts: Ragged
    responses: Ragged
    fields: TokenFields
    """Per-token old_logprobs, advantages, returns and old_values (the scoring's outputs)."""
    positive: list[bool]
    """[S] correct responses (the positive-example LM loss)."""
    trainable_policy: list[bool]
    """[S] samples the policy trains on (False: filtered as overlong)."""
    path: OutputPath
    """Which samples' fields each rank holds, and so trains on."""
    rollout_logprobs: torch.Tensor | None = None
    """[N] float32 vLLM's log-probs by the responses' offsets (the rollout correction's input)."""
    correction: RolloutCorrectionConfig | None = None
    """Rollout importance correction of the policy loss; None or off: none."""
    routes: tuple[torch.Tensor, torch.Tensor] | None = None
    """Routing replay: the engine's routes [T, layers, top_k] of the samples this rank's
    policy owns and their offsets [S + 1] (``step/engine_routes.py``: 0 rows for the other
    samples), replayed in the policy's update; None: off."""
    critic_routes: tuple[torch.Tensor, torch.Tensor] | None = None
    """An MoE critic's routes of its scoring pass on this rank's samples, as ``routes``
    (``step/critic_routes.py``), replayed in the critic's updates; None: off."""

    @property
    def critic_field_names(self) -> list[str]:
        """The per-token fields the critic's loss reads, and the routes its forward replays."""
        return CRITIC_FIELDS + [ROUTES] if self.critic_routes is not None else CRITIC_FIELDS

    @property
    def policy_field_names(self) -> list[str]:
        """The per-token fields the policy's loss reads (the correction's when it is on), and
        the routes its forward replays."""
        on = self.correction is not None and self.correction.enabled
        names = POLICY_FIELDS + CORRECTION_FIELDS if on else POLICY_FIELDS
        return names + [ROUTES] if self.routes is not None else names

    def critic_fields(self, i: int, flat: slice) -> dict[str, torch.Tensor]:
        length = flat.stop - flat.start
        return {name: self.fields.of(name, i, length) for name in CRITIC_FIELDS}

    def policy_fields(self, i: int, flat: slice) -> dict[str, torch.Tensor]:
        length = flat.stop - flat.start
        out = {
            "old_logprobs": self.fields.of("old_logprobs", i, length),
            "advantages": self.fields.of("advantages", i, length),
            # Per-sample constants as expanded scalars: packing writes them into the row; no
            # response-sized tensor is made for them.
            "positive": _BOOLS[self.positive[i]].expand(length),
            "seq_num_tokens": torch.tensor(float(length), device=HOST).expand(length),
        }
        if self.correction is not None and self.correction.enabled:
            if self.rollout_logprobs is None:
                raise ValueError(
                    "algorithm.rollout_correction is on but the step has no rollout log-probs"
                )
            weight, keep = rollout_weights(
                out["old_logprobs"], self.rollout_logprobs[flat],
                torch.tensor([0, length], device=HOST), self.correction,
            )  # fmt: skip
            out.update(rollout_weight=weight, rollout_keep=keep)
        return out

    def both_fields(self, i: int, flat: slice) -> dict[str, torch.Tensor]:
        return {**self.critic_fields(i, flat), **self.policy_fields(i, flat)}


_BOOLS = {flag: torch.tensor(flag, dtype=torch.bool, device=HOST) for flag in (False, True)}
"""The ``positive`` field's two values (expanded per sample, never written)."""


def run_updates(
    data: UpdateData,
    parts_of_epoch: Callable[[int], list[torch.Tensor]],
    *,
    epochs: int,
    algo: AlgoConfig,
    policy: ModelEngine | None,
    critic: ModelEngine | None,
    temperature: float,
    token_budget: int,
    timer: Timer,
) -> dict[str, float]:
    """Every PPO epoch's mini-batches (``parts_of_epoch(epoch)``), each a critic then a policy
    update. Returns the mean metrics over the mini-batches (critic/..., policy/...)."""
    critic_parts, policy_parts = [], []
    for epoch in range(epochs):
        for part in parts_of_epoch(epoch):
            critic_out, policy_out = update_minibatch(
                data, part.tolist(), algo=algo, policy=policy, critic=critic,
                temperature=temperature, token_budget=token_budget, timer=timer,
            )  # fmt: skip
            if critic_out is not None:
                critic_parts.append(critic_out)
            if policy_out is not None:
                policy_parts.append(policy_out)
    metrics = {**_mean_metrics(critic_parts, "critic"), **_mean_metrics(policy_parts, "policy")}
    metrics["num_minibatches"] = float(len(critic_parts) or len(policy_parts))
    return metrics


def _mean_metrics(parts: Sequence[dict[str, float]], prefix: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in {k for p in parts for k in p}:
        values = [p[name] for p in parts if name in p]
        out[f"{prefix}/{name}"] = sum(values) / len(values)
    return out


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
    critic_ids = data.path.mine(critic, chosen) if critic is not None else None
    trainable = [i for i in chosen if data.trainable_policy[i]] if policy is not None else []
    policy_ids = data.path.mine(policy, trainable) if trainable else None
    packed = None
    one_pack = data.path.packs_once and data.critic_routes is None
    if one_pack and critic_ids is not None and policy_ids == critic_ids:
        # One layout, the same samples: pack once for both models (unless the critic replays
        # routes of its own: one ROUTES field per micro-batch).
        samples = build_samples(
            data.prompts, data.responses, critic_ids, data.responses.offsets, data.both_fields,
            flat_index=False, routes=data.routes,
        )  # fmt: skip
        packed = micro_batches(
            samples, critic.layout, cp_rank=critic.cp_rank, token_budget=token_budget,
            field_names=CRITIC_FIELDS + data.policy_field_names,
        )  # fmt: skip
    critic_out = policy_out = None
    if critic_ids is not None:
        critic_out = _update(
            data, critic, critic_ids, data.critic_fields, lambda norm: value_loss_fn(algo, norm),
            data.critic_field_names, packed=packed, token_budget=token_budget,
            routes=data.critic_routes,
        )  # fmt: skip
        if timer is not None:
            timer.lap("update_critic")
    if policy_ids is not None:  # None: critic pretraining, or every sample overlong-filtered
        vocab = policy.vocab_slice
        policy_out = _update(
            data, policy, policy_ids, data.policy_fields,
            lambda norm: policy_loss_fn(
                algo, norm, vocab, temperature=temperature,
                mtp_loss_weight=policy.mtp_loss_weight,
            ),  # fmt: skip
            data.policy_field_names, packed=packed, token_budget=token_budget,
            routes=data.routes,
        )  # fmt: skip
        if timer is not None:
            timer.lap("update_policy")
    return critic_out, policy_out


def _update(
    data: UpdateData,
    engine: ModelEngine,
    ids: list[int],
    fields_fn: Callable[[int, slice], dict[str, torch.Tensor]],
    loss_fn_factory: Callable[[LossNormalisers], LossFn],
    names: list[str],
    *,
    packed: list[MicroBatch] | None,
    token_budget: int,
    routes: tuple[torch.Tensor, torch.Tensor] | None,
) -> dict[str, float]:
    """One model's gradient step on samples ``ids``: on the micro-batches ``packed`` for both
    models when given, else packed here with ``fields_fn``'s fields (and ``routes``, this
    model's routes to replay, where ``names`` has ROUTES)."""
    if packed is not None:
        return train_on_micro_batches(engine, packed, len(ids), loss_fn_factory, field_names=names)
    samples = build_samples(
        data.prompts, data.responses, ids, data.responses.offsets, fields_fn, flat_index=False,
        routes=routes if ROUTES in names else None,
    )  # fmt: skip
    return train_on_share(
        engine, samples, loss_fn_factory, field_names=names, token_budget=token_budget
    )


def train_on(
    engine: ModelEngine,
    samples: Sequence[Sample],
    loss_fn_factory: Callable[[LossNormalisers], LossFn],
    *,
    field_names: Sequence[str],
    token_budget: int,
) -> dict[str, float]:
    """Forward, backward and one optimizer step on ``samples`` (the whole mini-batch, the same
    list on every rank). Returns the mini-batch's metrics (global means) on every rank."""
    counts = [len(s.prompt) + len(s.response) for s in samples]
    mine = [samples[i] for i in dp_share(counts, engine.dp_size, engine.dp_rank)]
    return train_on_share(
        engine, mine, loss_fn_factory, field_names=field_names, token_budget=token_budget
    )


def train_on_share(
    engine: ModelEngine,
    mine: Sequence[Sample],
    loss_fn_factory: Callable[[LossNormalisers], LossFn],
    *,
    field_names: Sequence[str],
    token_budget: int,
) -> dict[str, float]:
    """As :func:`train_on`, given only this data-parallel rank's share ``mine`` of the
    mini-batch (``dp_share`` of the mini-batch's token counts): the other ranks' samples are
    never built here."""
    mbs = micro_batches(
        mine, engine.layout, cp_rank=engine.cp_rank, token_budget=token_budget,
        field_names=field_names,
    )  # fmt: skip
    return train_on_micro_batches(engine, mbs, len(mine), loss_fn_factory)


def train_on_micro_batches(
    engine: ModelEngine,
    mbs: Sequence[MicroBatch],
    num_samples: int,
    loss_fn_factory: Callable[[LossNormalisers], LossFn],
    *,
    field_names: Sequence[str] | None = None,
) -> dict[str, float]:
    """As :func:`train_on_share`, on this rank's share already packed (``num_samples``
    samples in ``mbs``): e.g. once for the critic and the policy where both take the same
    samples on one layout. ``field_names``: the fields this model's loss reads (the others
    stay behind, never copied to its device); None keeps every field. A model that runs in
    lockstep (``batching.runs_in_lockstep``: EP > 1) first pads ``mbs`` with empty
    micro-batches to as many as any of its DP ranks runs (``batching.line_up``, over the host
    group): they add nothing to the normalisers, losses, metrics or routes."""
    names = list(field_names) if field_names is not None else list(mbs[0].fields)
    mbs = line_up(
        mbs, engine.layout, cp_rank=engine.cp_rank, field_names=names,
        host_group=engine.groups.host,
    )  # fmt: skip
    if field_names is not None:  # routes only where packed (an empty micro-batch has none)
        mbs = [
            mb.with_fields([n for n in field_names if n != ROUTES or n in mb.fields]) for mb in mbs
        ]
    positive = [mb.fields.get("positive") for mb in mbs]  # None: the critic's (no such field)
    # Counted on the host where packing left the masks; reduced and used on the model's device.
    norm = global_loss_normalisers(
        [mb.response_mask for mb in mbs], positive, num_samples,
        dp_cp_group=engine.groups.parallel.dp_cp, cp_size=engine.layout.cp, device=engine.device,
    )  # fmt: skip
    outputs = engine.run(mbs, loss_fn_factory(norm))
    metrics = engine.step()
    metrics.update(sum_shares(engine, outputs))
    metrics["num_tokens"] = float(norm.num_tokens)
    if engine.router_replay is not None:
        metrics["route_agreement"] = route_agreement(engine)
    return metrics


def route_agreement(engine: ModelEngine) -> float:
    """The share of the engine's given experts (routing replay) that the model's own top-k
    also picked, over every forward since the last call (this step's scoring pass and
    updates), all ranks' routers (float64 sums over the host group; a TP replica counts its
    tokens again, which leaves the share as it is). NaN when nothing was given."""
    sums = engine.router_replay.take_agreement()
    all_reduce(sums, engine.groups.host)
    hits, given = sums.tolist()
    return hits / given if given else float("nan")


def sum_shares(engine: ModelEngine, outputs: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Sum metric shares over micro-batches and ranks: each is a share of a global mean, so the
    sum is that mean. Only the last stage's first TP rank of each (data, context) rank counts.
    The scalars come to the host in one copy and travel over the host group (a few floats)."""
    local: dict[str, float] = {}
    if engine.is_last_stage and engine.tp_rank == 0:
        names = [name for out in outputs for name, value in out.items() if value.dim() == 0]
        scalars = [value for out in outputs for value in out.values() if value.dim() == 0]
        values = torch.stack(scalars).to(HOST, torch.float64).tolist() if scalars else []
        for name, value in zip(names, values, strict=True):
            local[name] = local.get(name, 0.0) + value
    total: dict[str, float] = {}
    for part in all_gather_objects(local, engine.groups.host):
        for name, value in part.items():
            total[name] = total.get(name, 0.0) + value
    return total
