"""Rollout, reward and sample selection: the step's prompts -> graded trajectories.

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
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.algorithms.group_advantages import soft_overlong_penalty
from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.rewards.registry import score_responses
from vapo_megatron.trainer.batching import Ragged, gather_index, select_offsets

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

    def __len__(self) -> int:
        return self.group.numel()

    def select(self, samples: torch.Tensor) -> Trajectories:
        """Samples ``samples`` ([K] int64 indices, in that order); all of them in order shares
        the buffers instead of copying them."""
        if samples.numel() == len(self) and bool(
            (samples == torch.arange(len(self), device=samples.device)).all()
        ):
            return dataclasses.replace(self)
        index = gather_index(self.responses.offsets, samples)
        return Trajectories(
            prompts=self.prompts.select(samples),
            responses=Ragged(self.responses.values[index], select_offsets(self.responses.offsets, samples)),
            rollout_logprobs=self.rollout_logprobs[index],
            group=self.group[samples], prompt_index=self.prompt_index[samples],
            truncated=self.truncated[samples], score=self.score[samples],
            acc=self.acc[samples], reward=self.reward[samples],
        )  # fmt: skip

    @staticmethod
    def from_rows(
        meta: torch.Tensor,
        prompt_tokens: torch.Tensor,
        response_tokens: torch.Tensor,
        rollout_logprobs: torch.Tensor,
    ) -> Trajectories:
        """From the flat buffers and the [S, len(META_FIELDS)] float64 metadata rows."""
        cols = dict(zip(META_FIELDS, meta.T, strict=True))
        offsets = {
            name: torch.nn.functional.pad(cols[f"{name}_len"].long().cumsum(0), (1, 0))
            for name in ("prompt", "response")
        }
        return Trajectories(
            prompts=Ragged(prompt_tokens, offsets["prompt"]),
            responses=Ragged(response_tokens, offsets["response"]),
            rollout_logprobs=rollout_logprobs, group=cols["group"].long(),
            prompt_index=cols["prompt_index"].long(), truncated=cols["truncated"].bool(),
            score=cols["score"].clone(), acc=cols["acc"].clone(), reward=cols["score"].clone(),
        )  # fmt: skip

    def meta_rows(self) -> torch.Tensor:
        """[S, len(META_FIELDS)] float64, the inverse of ``from_rows``."""
        cols = {
            "group": self.group, "prompt_index": self.prompt_index,
            "prompt_len": self.prompts.lengths(), "response_len": self.responses.lengths(),
            "truncated": self.truncated, "score": self.score, "acc": self.acc,
        }  # fmt: skip
        return torch.stack([cols[name].to(torch.float64) for name in META_FIELDS], dim=1)


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
) -> Trajectories:
    """Generate ``n`` responses for this replica's share of ``prompts`` (TokenizedPrompt list,
    the same on every rank), grade them, and gather everyone's: every rank returns all
    ``len(prompts) * n`` trajectories in (group, sample) order. The trajectories and the
    counts travel over ``host_group`` (gloo) as host tensors: generation output is host data,
    and while vLLM still holds the GPU a gather on NCCL would stage it on the device."""
    import time

    share = replica_share(len(prompts), num_replicas, replica)
    start = time.perf_counter()
    outputs = engine.generate(
        [prompts[g].token_ids for g in share], n=n, temperature=temperature, top_p=top_p,
        max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, seed=seed,
    ) if len(share) else []  # fmt: skip
    generated = time.perf_counter()
    texts = [
        tokenizer.decode(_ids(o.response_token_ids), skip_special_tokens=True) for o in outputs
    ]
    items = []
    for o, text in zip(outputs, texts, strict=True):
        record = prompts[share[o.prompt_index]].record
        items.append((record.data_source, text, record.answer))
    results, grading = score_responses(items, routing, timeout_s=grader_timeout_s)
    graded = time.perf_counter()  # the copies below are bookkeeping, not grading
    meta: list[tuple] = []
    prompt_ids, response_ids, logprobs = array("i"), array("i"), array("f")
    for o, result in zip(outputs, results, strict=True):
        group = share[o.prompt_index]
        prompt = prompts[group].token_ids
        meta.append(
            (group, prompts[group].record.index, len(prompt), len(o.response_token_ids),
             o.finish_reason == "length", float(result.score), float(result.acc))
        )  # fmt: skip
        prompt_ids.extend(prompt)
        response_ids.extend(o.response_token_ids)
        logprobs.extend(o.logprobs)
    # The engine's per-token Python lists are copied into the arrays above: free them before
    # the gather, which holds every replica's tokens (the host's peak of the step).
    del outputs, texts, items, results
    counts = torch.tensor(
        [grading.num_errors, grading.num_timeouts, graded - generated, generated - start],
        dtype=torch.float64, device=HOST,
    )  # fmt: skip
    # The ranks of a replica hold the same samples (vLLM TP in lockstep): its first rank alone
    # hands them, and its counts, to the gather; replicas are consecutive rank groups.
    if dist.get_rank() % (dist.get_world_size() // num_replicas):
        meta, prompt_ids, response_ids, logprobs = [], array("i"), array("i"), array("f")
        counts.zero_()
    local = [
        torch.tensor(meta, dtype=torch.float64, device=HOST).reshape(-1),
        _host_tensor(prompt_ids, torch.int32),
        _host_tensor(response_ids, torch.int32),
        _host_tensor(logprobs, torch.float32),
    ]
    del prompt_ids, response_ids, logprobs  # the tensors above hold them now
    gathered_parts = []
    while local:  # each local buffer is freed once gathered: less at the peak
        gathered_parts.append(collectives.all_gather_varlen(local.pop(0), host_group))
    meta_all, prompt_all, response_all, logprob_all = gathered_parts
    collectives.all_reduce(counts, host_group)
    counts[2:] /= num_replicas  # mean seconds over replicas
    stats.grader_errors += int(counts[0])
    stats.grader_timeouts += int(counts[1])
    stats.reward_seconds += float(counts[2])
    stats.generate_seconds += float(counts[3])
    gathered = Trajectories.from_rows(
        meta_all.view(-1, len(META_FIELDS)), prompt_all, response_all, logprob_all
    )
    # Stable: the samples of a group keep their order.
    return gathered.select(torch.sort(gathered.group, stable=True).indices)


def _ids(tokens) -> list[int]:
    """Token ids as the list the tokenizer takes (the engine hands an ``array('i')``)."""
    return tokens.tolist() if isinstance(tokens, array) else list(tokens)


def _host_tensor(values: array, dtype: torch.dtype) -> torch.Tensor:
    """A host tensor over ``values`` (no copy). vLLM hands out Python lists; gathering them
    into an ``array`` and wrapping it is ~2x faster than ``torch.tensor`` on the lists.
    ``torch.frombuffer`` makes host tensors only, which is where generation output belongs."""
    if not values:
        return torch.zeros(0, dtype=dtype, device=HOST)
    return torch.frombuffer(values, dtype=dtype)


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
