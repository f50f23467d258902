"""The step's trajectories: sampled responses and their grades as flat host tensors.

Every rank holds the same ``Trajectories`` after the rollout's gather (``step/rollout.py``):
int32 prompt and response token ids and fp32 rollout log-probs in buffers with offsets, and
one float64 metadata row per sample, which is how they travel (never pickled). MoE policies
with routing replay add each sample's routed experts (``routes``, int16, by sequence-token
offsets: ``route_offsets``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vapo_megatron.parallel.devices import HOST
from vapo_megatron.step.batching import Ragged, gather_index, select_offsets

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
    rollout_logprobs: torch.Tensor
    """[N] float32: vLLM's log-prob of each response token, in the responses' flat order."""
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
    routes: torch.Tensor | None = None
    """[T, layers, top_k] int16: the engine's routed experts of every token it forwarded (the
    prompt, then the response but its last token: vLLM's ``routed_experts`` layout,
    ``rollout/route_recorder.py``), sample after sample by ``route_offsets``; None: dense model
    or no routing replay."""

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
        routes = None
        if self.routes is not None:
            routes = self.routes[gather_index(self.route_offsets(), samples)]
        return Trajectories(
            prompts=self.prompts.select(samples),
            responses=Ragged(self.responses.values[index], select_offsets(self.responses.offsets, samples)),
            rollout_logprobs=self.rollout_logprobs[index],
            group=self.group[samples], prompt_index=self.prompt_index[samples],
            truncated=self.truncated[samples], score=self.score[samples],
            acc=self.acc[samples], reward=self.reward[samples], routes=routes,
        )  # fmt: skip

    @staticmethod
    def from_rows(
        meta: torch.Tensor,
        prompt_tokens: torch.Tensor,
        response_tokens: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        routes: torch.Tensor | None = None,
    ) -> Trajectories:
        """From the flat buffers and the [S, len(META_FIELDS)] float64 metadata rows (and the
        routes [T, layers, top_k], T = sum of prompt + response - 1)."""
        cols = dict(zip(META_FIELDS, meta.T, strict=True))
        offsets = {
            name: torch.nn.functional.pad(cols[f"{name}_len"].long().cumsum(0), (1, 0))
            for name in ("prompt", "response")
        }
        if routes is not None:
            rows = int(route_offsets(offsets["prompt"].diff(), offsets["response"].diff())[-1])
            if routes.dim() != 3 or routes.shape[0] != rows:
                raise ValueError(
                    f"routes must be [{rows}, layers, top_k] (prompt + response - 1 rows per "
                    f"sample), got {tuple(routes.shape)}"
                )
        return Trajectories(
            prompts=Ragged(prompt_tokens, offsets["prompt"]),
            responses=Ragged(response_tokens, offsets["response"]),
            rollout_logprobs=rollout_logprobs, group=cols["group"].long(),
            prompt_index=cols["prompt_index"].long(), truncated=cols["truncated"].bool(),
            score=cols["score"].clone(), acc=cols["acc"].clone(), reward=cols["score"].clone(),
            routes=routes,
        )  # fmt: skip

    def meta_rows(self) -> torch.Tensor:
        """[S, len(META_FIELDS)] float64, the inverse of ``from_rows``."""
        cols = {
            "group": self.group, "prompt_index": self.prompt_index,
            "prompt_len": self.prompts.lengths(), "response_len": self.responses.lengths(),
            "truncated": self.truncated, "score": self.score, "acc": self.acc,
        }  # fmt: skip
        return torch.stack([cols[name].to(torch.float64) for name in META_FIELDS], dim=1)


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
    with_routes = [p.routes is not None for p in parts]
    if any(with_routes) and not all(with_routes):
        raise ValueError("cannot concatenate trajectories with and without routes")
    return Trajectories.from_rows(
        rows,
        torch.cat([p.prompts.values for p in parts]),
        torch.cat([p.responses.values for p in parts]),
        torch.cat([p.rollout_logprobs for p in parts]),
        torch.cat([p.routes for p in parts]) if all(with_routes) else None,
    )
