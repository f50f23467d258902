"""What a rank writes to a training checkpoint, the pinned host memory one GPU's rank holds
(both described in ``planning/memory.py``'s module doc) and the ordinary host memory of
routing replay's routes (:func:`route_host_parts`): the planner's host side.

MoE: megatron's fully parallel save balances the shards a model's DP x CP group holds over
that group. With expert TP equal to TP (the default) such a group spans every EP rank of its
TP rank, so it holds each expert's shard once per expert-DP replica: its unique tensors are
the stage's dense share plus every expert's (EP x the local experts); with another ETP the
same formula, scaled by ETP / TP, is an estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.models.config import Head, HFModelConfig
from vapo_megatron.planning.params import (
    is_moe_layer,
    layer_replicated_count,
    moe_layer_count,
    shard_param_split,
    shard_tensor_numels,
)
from vapo_megatron.planning.workload import GIB, Workload

VLLM_CUDA_GRAPHS = 1 * GIB
"""vLLM's CUDA-graph pool without enforce_eager (an estimate; counted inside its budget)."""
VLLM_RUNTIME_POOL = 256 << 20
"""vLLM's "runtime" cuMem pool (state built with the KV cache: input batch, block tables,
attention metadata buffers; an estimate). Inside VLLM_OVERHEAD while awake; on the host while
asleep, back on the device from the weights' wake."""
PINNED_ROUNDING_UNKNOWN = 1.5
"""Pinned bytes per byte asked where the block sizes are not known: torch's caching host
allocator rounds each block up to a power of two, 1/ln 2 = 1.44 times the size on average over
sizes spread evenly on a log scale (an estimate)."""

Models = dict[Head, tuple[HFModelConfig, ModelLayout]]
"""Each trained model by head: its own config and layout (the critic may be another model)."""


@dataclass(frozen=True, kw_only=True)
class HostPart:
    """Host memory one GPU's rank holds for one purpose (pinned, or ordinary)."""

    nbytes: int
    label: Literal["exact", "estimated"]
    what: str
    """What holds it and why the figure is what it is (one line)."""


PinnedPart = HostPart


def distributed_optimizer(work: Workload, head: Head) -> bool:
    """Whether the model with ``head`` shards its Adam state (the critic's own setting)."""
    if head == "value" and work.critic_distributed_optimizer is not None:
        return work.critic_distributed_optimizer
    return work.distributed_optimizer


def tp_replicated_param_count(
    hf: HFModelConfig, layout: ModelLayout, *, head: Head, pp_rank: int, mtp: bool = False
) -> int:
    """Parameters every TP rank of a stage holds whole: the RMSNorm weights (q and k norms,
    MLA's q and kv norms too), the MoE routers (and the value head; the multi-token-prediction
    layers' norms and router on the last stage). A checkpoint stores them once, from TP rank 0."""
    per_stage = hf.num_layers // layout.pp
    layers = range(pp_rank * per_stage, (pp_rank + 1) * per_stage)
    count = sum(layer_replicated_count(hf, moe=is_moe_layer(hf, n)) for n in layers)
    if pp_rank == layout.pp - 1:
        count += hf.hidden_size * (2 if head == "value" else 1)  # final norm, value head
        if head == "lm" and mtp:  # enorm, hnorm, final norm, the layer's
            last = layer_replicated_count(hf, moe=is_moe_layer(hf, hf.num_layers - 1))
            count += hf.mtp_num_layers * (3 * hf.hidden_size + last)
    return count


def checkpoint_bytes(
    hf: HFModelConfig,
    layout: ModelLayout,
    work: Workload,
    *,
    head: Head,
    pp_rank: int,
    tp_rank: int = 0,
) -> int:
    """Tensor bytes one rank writes to a training checkpoint: its stage's weights and Adam
    state split evenly over the DP x CP ranks, as megatron's fully parallel save balances
    them (the distributed optimizer's shards are split so already); weights replicated over
    TP (norms, router) only from TP rank 0, and with the plain optimizer their Adam state too
    (the distributed optimizer saves each TP rank's buckets whole). Per parameter: the weight,
    two fp32 moments and an fp32 main copy, except with fp32 weights and the plain optimizer
    (its main copy is the weight); the distributed optimizer saves its main copy even in fp32.
    Experts: every EP rank's (module doc)."""
    mtp = work.builds_mtp(head)
    dense, expert = shard_param_split(hf, layout, head=head, pp_rank=pp_rank, mtp=mtp)
    params = dense + expert * layout.ep * layout.expert_tp // layout.tp
    sharded = distributed_optimizer(work, head)
    weight = 2 if work.bf16 else 4
    per_param = weight + 8 + (4 if work.bf16 or sharded else 0)
    total = params * per_param
    if tp_rank > 0:  # the distributed optimizer's buckets are per TP rank, norms included
        replicated = tp_replicated_param_count(hf, layout, head=head, pp_rank=pp_rank, mtp=mtp)
        total -= replicated * (weight if sharded else per_param)
    return math.ceil(total / (work.world_size // (layout.tp * layout.pp)))


def pinned_block(nbytes: int) -> int:
    """Bytes torch's caching host allocator pins for one request of ``nbytes`` (torch 2.13
    with default settings: the next power of two; ``ATen/core/CachingHostAllocator.h``)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def pinned_rounding(nbytes: list[int]) -> float:
    """Pinned bytes per byte asked when each of ``nbytes`` is asked for on its own."""
    return sum(pinned_block(n) for n in nbytes) / sum(nbytes)


def checkpoint_staging_bytes(models: Models, work: Workload) -> int:
    """Pinned bytes megatron's save stages per GPU (estimated, module doc): each model's
    largest per-rank share (:func:`checkpoint_bytes`), rounded as its stage's tensors round
    (fp32 state has the weights' shapes at twice the bytes: the same factor); both models at
    once when async, else the larger (a sync save reuses the cached blocks part after part)."""
    shares = []
    for head, (hf, layout) in models.items():
        per_stage = []
        for pp_rank in range(layout.pp):
            mtp = work.builds_mtp(head)
            tensors = shard_tensor_numels(hf, layout, head=head, pp_rank=pp_rank, mtp=mtp)
            share = checkpoint_bytes(hf, layout, work, head=head, pp_rank=pp_rank)
            per_stage.append(share * pinned_rounding([2 * n for n in tensors]))
        shares.append(max(per_stage))
    return math.ceil(sum(shares) if work.checkpoint_async else max(shares))


def pinned_parts(models: Models, work: Workload, state_bytes: int) -> dict[str, PinnedPart]:
    """Pinned host memory one GPU's rank holds, by part (``planning/memory.py``'s module doc);
    ``state_bytes``: both models' params + Adam bytes per GPU (the offloaded training state)."""
    parts = {}
    if work.offload == "rollout":
        parts["training_state"] = PinnedPart(
            nbytes=state_bytes, label="exact",
            what="offloaded params + Adam state while vLLM is awake (grads dropped; one arena "
            "of exactly this size)",
        )  # fmt: skip
    staged = "both models: async" if work.checkpoint_async else "the larger model: sync"
    parts["checkpoint_staging"] = PinnedPart(
        nbytes=checkpoint_staging_bytes(models, work), label="estimated",
        what=f"megatron's save staging ({staged}), power-of-two blocks kept cached by torch",
    )  # fmt: skip
    if work.sleep_level == 1:
        vllm_layout = ModelLayout(tp=work.rollout_tp)
        tensors = shard_tensor_numels(models["lm"][0], vllm_layout, head="lm", pp_rank=0)
        parts["vllm_weights"] = PinnedPart(
            nbytes=sum(pinned_block(2 * n) for n in tensors), label="estimated",
            what="vLLM level-1 sleep: its bf16 weight shard, each tensor a power-of-two block",
        )  # fmt: skip
    if not work.enforce_eager:
        parts["vllm_cuda_graphs"] = PinnedPart(
            nbytes=math.ceil(VLLM_CUDA_GRAPHS * PINNED_ROUNDING_UNKNOWN), label="estimated",
            what="vLLM sleep: its CUDA-graph pool (sleep_mode_offload_cudagraph)",
        )  # fmt: skip
    parts["vllm_runtime"] = PinnedPart(
        nbytes=math.ceil(VLLM_RUNTIME_POOL * PINNED_ROUNDING_UNKNOWN), label="estimated",
        what="vLLM sleep: its runtime pool (input batch, block tables)",
    )  # fmt: skip
    return parts


def step_tokens(work: Workload) -> int:
    """Tokens of a step's samples as the planner counts them (estimated): the longest prompt
    and the mean response (``mean_response_fraction``) each, as ``Plan.rollout_seconds``."""
    return math.ceil(
        work.samples_per_step * (work.prompt_len + work.mean_response_fraction * work.response_len)
    )


def route_host_parts(models: Models, work: Workload) -> dict[str, HostPart]:
    """Ordinary (not pinned) host memory of routing replay on the rank that holds the most:
    a rollout replica's first rank (``step/engine_routes.py``, ``step/critic_routes.py``).
    Routes are int16 [tokens, MoE layers, top_k]; a rank keeps its DP share of the step's over its
    stage's layers (1 / PP of them). The holder keeps its replica's share of the step's over
    every layer (the store), and while it sends them, one round's buffer: each sample once
    over every stage's layers, the store's size; each rank then puts what it received in
    sample order, a second copy of its share, while the received buffer is alive. Empty
    without routing replay or for a dense model."""
    tokens = step_tokens(work)
    parts: dict[str, HostPart] = {}
    hf, layout = models["lm"]
    if work.routing_replay and hf.is_moe:
        step = tokens * moe_layer_count(hf) * hf.moe_top_k * 2
        store = math.ceil(step / (work.world_size // work.rollout_tp))
        dp = work.world_size // (layout.tp * layout.pp * layout.cp)
        share = math.ceil(step / dp / layout.pp)
        parts["route_store"] = HostPart(
            nbytes=store, label="estimated",
            what="the engine's routes of its rollout replica's samples, every layer (the "
            "replica's first rank, the whole step)",
        )  # fmt: skip
        parts["route_exchange"] = HostPart(
            nbytes=max(store, share), label="estimated",
            what="while sending: one round's send buffer (each sample once: the store's size), "
            "then the received routes before they are put in sample order",
        )  # fmt: skip
        parts["policy_routes"] = HostPart(
            nbytes=share, label="estimated",
            what="the policy's DP share of the step's routes over its stage's layers (replayed "
            "in its scoring pass and updates; every rank)",
        )  # fmt: skip
    critic = models.get("value")
    if critic is not None and work.critic_routing_replay and critic[0].is_moe:
        chf, clayout = critic
        step = tokens * moe_layer_count(chf) * chf.moe_top_k * 2
        dp = work.world_size // (clayout.tp * clayout.pp * clayout.cp)
        share = math.ceil(step / dp / clayout.pp)
        parts["critic_routes"] = HostPart(
            nbytes=share, label="estimated",
            what="an MoE critic's routes of its scoring pass, its DP share over its stage's "
            "layers (replayed in its updates; every rank)",
        )  # fmt: skip
    return parts


def route_host_peak(parts: dict[str, HostPart]) -> int:
    """The most of :func:`route_host_parts`' bytes one rank holds at once: the store and the
    policy's share the whole step, the exchange's buffers only before the scoring pass that
    records the critic's routes."""
    nbytes = {name: part.nbytes for name, part in parts.items()}
    during = max(nbytes.get("route_exchange", 0), nbytes.get("critic_routes", 0))
    return nbytes.get("route_store", 0) + nbytes.get("policy_routes", 0) + during
