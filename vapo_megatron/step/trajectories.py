"""The step's trajectories: sampled responses and their grades as flat host tensors.

Every rank holds the same ``Trajectories`` after the rollout's gather (``step/rollout.py``):
int32 prompt and response token ids and fp32 rollout log-probs in buffers with offsets, and
one float64 metadata row per sample, which is how they travel (never pickled). MoE policies
with routing replay add where each sample's routed experts sit (``route_at``: they stay on
the rank that generated them until the step sends them to the ranks that train on the sample,
``step/engine_routes.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vapo_megatron.parallel.devices import HOST
from vapo_megatron.step.batching import Ragged, gather_index, select_offsets

if TYPE_CHECKING:
    from vapo_megatron.step.engine_routes import RouteStore

# Per-sample metadata travels as one float64 row per sample (integers are exact below 2^53).
META_FIELDS = ("group", "prompt_index", "prompt_len", "response_len", "truncated", "score", "acc")


@dataclass
class Trajectories:
    """The step's sampled responses and their grades as flat host tensors (no Python objects
    per sample); identical on every rank after the gather. S samples, P prompt and N response
    tokens in all; samples of one prompt group are consecutive."""

    prompts: Ragged
    """Prompt token ids: int32 [P] with offsets [S + 1]."""
    responses: Ragged
    """Response token ids: int32 [N] with offsets [S + 1] (each ends with EOS unless truncated)."""
    rollout_logprobs: torch.Tensor | None
    """[N] float32: vLLM's log-prob of each response token, in the responses' flat order.
    ``run_step`` drops it (None) once the scoring pass has measured the log-prob gap, unless
    the rollout correction reads it in the policy's update."""
    group: torch.Tensor
    """[S] int64: index of the sample's prompt group in the step."""
    prompt_index: torch.Tensor
    """[S] int64: row of the prompt in the training set."""
    truncated: torch.Tensor
    """[S] bool: the response hit max_new_tokens."""
    score: torch.Tensor
    """[S] float64: the grader's score (DAPO: +1 / -1)."""
    acc: torch.Tensor
    """[S] float64: 1.0 correct, 0.0 wrong."""
    reward: torch.Tensor
    """[S] float64: score plus shaping (overlong penalty), what GAE receives at the last token."""
    route_at: torch.Tensor | None = None
    """[S, 2] int64: where the engine's routed experts of each sample sit (routing replay):
    the holder's host-group rank and the first of the sample's ``route_offsets`` rows in the
    holder's ``route_store`` (int16 [rows, layers, top_k]: every token the engine forwarded,
    the prompt, then the response but its last token: vLLM's ``routed_experts`` layout,
    ``rollout/route_recorder.py``); None: dense model or no routing replay."""
    route_store: RouteStore | None = None
    """This rank's part of the step's routes (``step/engine_routes.py``); with ``route_at``."""
    version: torch.Tensor | None = None
    """[S] int64: the policy version (updates applied) that generated each sample, set by
    the rollout queue (``step/rollout_queue.py``); None: the step's own weights."""

    def __len__(self) -> int:
        return self.group.numel()

    def route_offsets(self) -> torch.Tensor:
        """[S + 1] int64: sample i's routes are rows ``routes[o[i]:o[i + 1]]`` (prompt +
        response - 1 rows each)."""
        return route_offsets(self.prompts.lengths(), self.responses.lengths())

    def select(self, samples: torch.Tensor) -> Trajectories:
        """Samples ``samples`` ([K] int64 indices, in that order); all of them in order shares
        the buffers instead of copying them."""
        if samples.numel() == len(self) and bool(
            (samples == torch.arange(len(self), device=samples.device)).all()
        ):
            return dataclasses.replace(self)
        index = gather_index(self.responses.offsets, samples)
        route_at = self.route_at[samples] if self.route_at is not None else None
        return Trajectories(
            prompts=self.prompts.select(samples),
            responses=Ragged(self.responses.values[index], select_offsets(self.responses.offsets, samples)),
            rollout_logprobs=self.rollout_logprobs[index],
            group=self.group[samples], prompt_index=self.prompt_index[samples],
            truncated=self.truncated[samples], score=self.score[samples],
            acc=self.acc[samples], reward=self.reward[samples], route_at=route_at,
            route_store=self.route_store,
            version=self.version[samples] if self.version is not None else None,
        )  # fmt: skip

    @staticmethod
    def from_rows(
        meta: torch.Tensor,
        prompt_tokens: torch.Tensor,
        response_tokens: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        route_at: torch.Tensor | None = None,
        route_store: RouteStore | None = None,
    ) -> Trajectories:
        """From the flat buffers and the [S, len(META_FIELDS)] float64 metadata rows (and
        where the samples' routes sit: ``route_at`` [S, 2] int64, ``route_store``)."""
        cols = dict(zip(META_FIELDS, meta.T, strict=True))
        offsets = {
            name: torch.nn.functional.pad(cols[f"{name}_len"].long().cumsum(0), (1, 0))
            for name in ("prompt", "response")
        }
        if route_at is not None and (
            route_store is None or tuple(route_at.shape) != (meta.shape[0], 2)
        ):
            raise ValueError(
                f"route_at must be [{meta.shape[0]}, 2] (holder, first row) with a route_store; "
                f"got {tuple(route_at.shape)} and {route_store}"
            )
        return Trajectories(
            prompts=Ragged(prompt_tokens, offsets["prompt"]),
            responses=Ragged(response_tokens, offsets["response"]),
            rollout_logprobs=rollout_logprobs, group=cols["group"].long(),
            prompt_index=cols["prompt_index"].long(), truncated=cols["truncated"].bool(),
            score=cols["score"].clone(), acc=cols["acc"].clone(), reward=cols["score"].clone(),
            route_at=route_at, route_store=route_store,
        )  # fmt: skip

    def meta_rows(self) -> torch.Tensor:
        """[S, len(META_FIELDS)] float64, the inverse of ``from_rows``."""
        cols = {
            "group": self.group, "prompt_index": self.prompt_index,
            "prompt_len": self.prompts.lengths(), "response_len": self.responses.lengths(),
            "truncated": self.truncated, "score": self.score, "acc": self.acc,
        }  # fmt: skip
        return torch.stack([cols[name].to(torch.float64) for name in META_FIELDS], dim=1)


FLAT_FIELDS = ("meta", "reward", "sample_version", "prompt_ids", "response_ids", "rollout_logprobs")
"""A batch as flat host tensors, routes aside (``flat_fields``): the metadata rows, float64
rewards, int64 sample versions, int32 prompt and response token ids, float32 log-probs."""


def flat_fields(t: Trajectories) -> dict[str, torch.Tensor | None]:
    """``t`` as the flat tensors of :data:`FLAT_FIELDS` (in that order), which
    ``from_flat_fields`` rebuilds it from: the form a batch is checkpointed in and sent in."""
    return {
        "meta": t.meta_rows(), "reward": t.reward.to(torch.float64),
        "sample_version": t.version, "prompt_ids": t.prompts.values,
        "response_ids": t.responses.values, "rollout_logprobs": t.rollout_logprobs,
    }  # fmt: skip


def empty_flat_fields(samples: int, prompt_tokens: int, response_tokens: int) -> dict:
    """Uninitialised host buffers of :data:`FLAT_FIELDS` for a batch of those sizes (to
    receive one into)."""
    shapes = {
        "meta": ((samples, len(META_FIELDS)), torch.float64), "reward": ((samples,), torch.float64),
        "sample_version": ((samples,), torch.long), "prompt_ids": ((prompt_tokens,), torch.int32),
        "response_ids": ((response_tokens,), torch.int32),
        "rollout_logprobs": ((response_tokens,), torch.float32),
    }  # fmt: skip
    return {
        name: torch.empty(shapes[name][0], dtype=shapes[name][1], device=HOST)
        for name in FLAT_FIELDS
    }


def from_flat_fields(
    fields: dict, route_at: torch.Tensor | None = None, route_store: RouteStore | None = None
) -> Trajectories:
    """The batch ``flat_fields`` wrote (its routes at ``route_at`` in ``route_store``)."""
    out = Trajectories.from_rows(
        fields["meta"], fields["prompt_ids"], fields["response_ids"], fields["rollout_logprobs"],
        route_at, route_store,
    )  # fmt: skip
    out.reward, out.version = fields["reward"], fields["sample_version"]
    return out


def route_offsets(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor) -> torch.Tensor:
    """[S + 1] int64 offsets of each sample's routes: prompt + response - 1 rows (every token
    the engine forwarded; a sample with no response has its prompt's but the last)."""
    rows = (prompt_lengths.long() + response_lengths.long() - 1).clamp(min=0)
    return torch.nn.functional.pad(rows.cumsum(0), (1, 0))


def group_samples(groups: torch.Tensor, n: int) -> torch.Tensor:
    """[G * n] sample indices of the groups ``groups`` [G] (n consecutive samples each)."""
    return (groups[:, None] * n + torch.arange(n, device=HOST)[None]).reshape(-1)


def concat(parts: Sequence[Trajectories]) -> Trajectories:
    """The samples of ``parts``, one after the other."""
    if len(parts) == 1:
        return parts[0]
    rows = torch.cat([p.meta_rows() for p in parts])
    with_routes = [p.route_at is not None for p in parts]
    if any(with_routes) and not all(with_routes):
        raise ValueError("cannot concatenate trajectories with and without routes")
    stores = {id(p.route_store) for p in parts}
    if all(with_routes) and len(stores) != 1:
        raise ValueError("cannot concatenate trajectories whose routes sit in other stores")
    return Trajectories.from_rows(
        rows,
        torch.cat([p.prompts.values for p in parts]),
        torch.cat([p.responses.values for p in parts]),
        torch.cat([p.rollout_logprobs for p in parts]),
        torch.cat([p.route_at for p in parts]) if all(with_routes) else None,
        parts[0].route_store,
    )
