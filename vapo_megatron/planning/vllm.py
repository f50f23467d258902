"""vLLM's side of a plan: its weight shard, its KV cache per token, and the decode-time model
both placements are estimated with (colocated: every rank a rollout rank between updates;
separate: rollout ranks of their own, ``planning/placement.py``).

A replica is ``tp`` x ``dp`` ranks (:class:`RolloutLayout`): attention and dense weights split
over ``tp``; an MoE model's experts split over all ``tp x dp`` ranks, each group of ``tp``
ranks running its own sequences (vLLM's data-parallel attention with expert parallelism,
``enable_expert_parallel``; ``dp`` 1: experts split over TP only, the same bytes per rank).
Multi-head latent attention caches the compressed kv and the RoPE key of each token
(kv_lora_rank + qk_rope_head_dim per layer), whole on every TP rank of its group: TP does not
shrink it, data-parallel attention does (each group caches only its own sequences).

Decode (estimated): each step of a group generates one token of each of its ``concurrent``
sequences (as many mean-length sequences as its KV cache holds); a rank reads its weight
shard and its share of the batch's KV (half the mean length on average) at DECODE_EFFICIENCY
of the HBM bandwidth, or computes 2 x active parameters x sequences / tp FLOPs at
DECODE_COMPUTE_EFFICIENCY of its bf16 peak, whichever is slower; plus the step's collectives'
latency: two TP all-reduces per layer, and per MoE layer a dispatch and a combine all-to-all
over the replica (across nodes when it spans more than one). A batch of concurrent sequences
routes to nearly every expert: the whole shard is read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.planning.params import (
    active_param_count,
    layer_expert_numels,
    moe_layer_count,
    total_param_count,
)
from vapo_megatron.planning.presets import GPUSpec
from vapo_megatron.planning.workload import Workload

DECODE_EFFICIENCY = 0.5
"""Share of the HBM bandwidth a decode step reaches (an estimate)."""
DECODE_COMPUTE_EFFICIENCY = 0.5
"""Share of the bf16 peak a compute-bound decode step reaches (an estimate)."""
TP_ALLREDUCE_SECONDS = 10e-6
"""Latency of one small all-reduce over vLLM's TP group inside a node (an estimate)."""
EP_ALLTOALL_SECONDS = {"node": 25e-6, "cluster": 60e-6}
"""Latency of one decode step's dispatch or combine all-to-all inside a node and across
nodes (estimates)."""


@dataclass(frozen=True, kw_only=True)
class RolloutLayout:
    """One vLLM replica: ``tp`` x ``dp`` ranks (module doc)."""

    tp: int = 1
    """Tensor parallelism of attention and the dense weights."""
    dp: int = 1
    """Data-parallel attention groups whose experts are split over all tp x dp ranks (MoE);
    1: a plain TP replica."""

    @property
    def ranks(self) -> int:
        return self.tp * self.dp

    def describe(self) -> str:
        if self.dp == 1:
            return f"TP {self.tp}"
        return f"TP {self.tp} x DP-attention {self.dp}, EP {self.ranks}"


def expert_param_count(hf: HFModelConfig) -> int:
    """Routed experts' parameters of the decoder (no MTP layers: vLLM does not load them)."""
    return sum(layer_expert_numels(hf, ModelLayout())) * moe_layer_count(hf)


def vllm_weight_bytes(hf: HFModelConfig, layout: RolloutLayout) -> int:
    """bf16 weights one vLLM rank holds (exact): the dense part over TP, the experts over
    the replica; the multi-token-prediction layers are not loaded (vLLM skips them)."""
    expert = expert_param_count(hf)
    dense = total_param_count(hf, head="lm", mtp=False) - expert
    return 2 * (dense // layout.tp + expert // layout.ranks)


def kv_bytes_per_token(hf: HFModelConfig, tp: int) -> int:
    """bf16 KV-cache bytes of one token on one vLLM rank (module doc): GQA's k and v of its
    share of the KV heads (replicated when TP exceeds them); MLA's compressed kv + RoPE key."""
    if hf.mla is not None:
        return hf.num_layers * (hf.mla.kv_lora_rank + hf.mla.qk_rope_head_dim) * 2
    kv_heads_per_rank = max(hf.num_key_value_heads // tp, 1)
    return 2 * hf.num_layers * kv_heads_per_rank * hf.head_dim * 2


@dataclass(frozen=True, kw_only=True)
class Decode:
    """What a rollout over ``ranks`` ranks generates and how long it takes (estimated)."""

    layout: RolloutLayout
    ranks: int
    """Ranks that generate (a multiple of the replica's)."""
    kv_cache: int
    """KV-cache bytes per rank."""
    kv_per_token: int
    """KV bytes per token per rank."""
    weights: int
    """Weight bytes per rank."""
    sequences_per_group: float
    """Full-length (prompt + longest response) sequences one attention group's cache holds."""
    seconds: float
    """Estimated generation time of one step's samples; inf when a group cannot hold one."""

    @property
    def sequences_per_replica(self) -> float:
        return self.sequences_per_group * self.layout.dp


def decode(
    hf: HFModelConfig,
    gpu: GPUSpec,
    layout: RolloutLayout,
    work: Workload,
    *,
    ranks: int,
    kv_cache: int,
    samples: int | None = None,
) -> Decode:
    """The rollout estimate of the module doc for ``samples`` responses (None: the step's,
    ``work.samples_per_step``) of ``work``'s lengths on ``ranks`` ranks laid out as
    ``layout``, each with ``kv_cache`` bytes of KV cache."""
    samples = work.samples_per_step if samples is None else samples
    kv_tok = kv_bytes_per_token(hf, layout.tp)
    weights = vllm_weight_bytes(hf, layout)
    mean_response = work.response_len * work.mean_response_fraction
    mean_len = work.prompt_len + mean_response
    per_group = samples / (ranks // layout.tp)
    concurrent = min(per_group, kv_cache / (kv_tok * mean_len))
    full = kv_cache / (kv_tok * work.sequence_len)
    result = Decode(layout=layout, ranks=ranks, kv_cache=kv_cache, kv_per_token=kv_tok,
                    weights=weights, sequences_per_group=full, seconds=math.inf)  # fmt: skip
    if concurrent < 1:
        return result
    read = weights + concurrent * kv_tok * mean_len / 2
    flops = 2 * active_param_count(hf, head="lm") * concurrent / layout.tp
    step = max(read / (gpu.hbm_bytes_per_s * DECODE_EFFICIENCY),
               flops / (gpu.bf16_flops * DECODE_COMPUTE_EFFICIENCY))  # fmt: skip
    step += step_latency(hf, layout, work.gpus_per_node)
    steps = per_group / concurrent * mean_response
    return replace(result, seconds=steps * step)


def step_latency(hf: HFModelConfig, layout: RolloutLayout, gpus_per_node: int) -> float:
    """Seconds of collectives' latency per decode step (module doc; estimated)."""
    seconds = 2 * hf.num_layers * TP_ALLREDUCE_SECONDS if layout.tp > 1 else 0.0
    if layout.dp > 1:
        scope = "node" if layout.ranks <= gpus_per_node else "cluster"
        seconds += 2 * moe_layer_count(hf) * EP_ALLTOALL_SECONDS[scope]
    return seconds
