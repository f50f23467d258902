"""Rollouts on ranks of their own (``rollout.placement: separate``): how many of a job's ranks
should generate, how their vLLM replicas are laid out, and the step time of each placement
(estimated; every constant below is an estimate, labelled so in ``tools/plan.py``).

The model (docs/scaling.md, "Rollouts on ranks of their own"):

- **Training** of one step is FLOPs / (ranks x bf16 peak x TRAIN_MFU). Per model and token
  of the step's samples (``host.step_tokens``: the longest prompt and the mean response), a
  forward is 2 x active parameters plus causal attention over half the mean sequence
  (2 x context x heads x (q/k + v head widths) per layer); the scoring pass is one forward,
  each of ``ppo_epochs`` updates a forward and a backward (3 forwards) plus the recomputed
  share of a forward (the recipe's recompute). Pipeline bubbles and communication are inside
  TRAIN_MFU.
- **Rollout** is ``planning/vllm.py::decode`` (waves of as many mean-length sequences as a
  group's KV cache holds), plus the **tail**: a step's last wave runs until its longest
  response is done, (longest - mean response) decode steps of one sequence. Every step of a
  fixed schedule has it, in both placements (a step's samples come from one policy version).
- **Colocated (synchronous)** step on N ranks = rollout + tail (every rank generates, at the
  recipe's vLLM TP and memory share) + training on N + the switch: the training state to the
  host and back (``rollout.offload_training_state``) at HOST_COPY_BYTES_PER_S.
- **Separate (overlapped)** step: R rollout ranks generate step s + k's samples while T = N - R
  ranks train step s (lag k >= 1): step = max(training on T, rollout + tail on R) + the
  weight transfer (the policy's bf16 weights, once over the trainer -> rollout group at
  WEIGHT_TRANSFER_BYTES_PER_S; neither side works while it runs). Rollout ranks hold no
  training state: their memory less the reserve, the headroom, one sync message and the layer
  vLLM holds while it loads (``sync_hold_bytes``) is vLLM's, its KV cache what its weights
  leave. Trainer ranks hold no vLLM.

R is chosen so that neither side waits: the split with the shortest overlapped step, among
those whose trainer world fits both models' layouts and memory, with the fastest rollout
layout each (vLLM TP inside a node; for an MoE model also data-parallel attention with the
experts over the replica, across nodes where that is faster).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.models.config import Head, HFModelConfig
from vapo_megatron.planning import memory as mp
from vapo_megatron.planning.host import Models, step_tokens
from vapo_megatron.planning.params import active_param_count
from vapo_megatron.planning.presets import GPUSpec
from vapo_megatron.planning.vllm import Decode, RolloutLayout, decode, vllm_weight_bytes
from vapo_megatron.planning.workload import Recompute, Workload

TRAIN_MFU = 0.4
"""Share of the bf16 peak an update reaches, bubbles and communication included (an estimate;
docs/scaling.md's 40 %)."""
WEIGHT_TRANSFER_BYTES_PER_S = 10e9
"""Trainer -> rollout ranks weight transfer (an estimate: verl reports 8.25 GB/s for
Qwen3-30B-A3B over NCCL, ../shared/ASYNC.md)."""
HOST_COPY_BYTES_PER_S = 20e9
"""Device <-> pinned host copies per GPU (PCIe 5; an estimate)."""


def recompute_share(recompute: Recompute, stage_layers: int) -> float:
    """Share of a forward that the recipe's recompute runs again in backward."""
    granularity, method, num_layers = recompute
    if granularity != "full":
        return 0.0
    return 1.0 if method == "uniform" else min(num_layers or 0, stage_layers) / stage_layers


def forward_flops_per_token(hf: HFModelConfig, work: Workload, *, head: Head) -> float:
    """FLOPs of one forward per token (module doc): matmuls over the active parameters and
    causal attention over half the mean sequence."""
    mean_len = work.prompt_len + work.mean_response_fraction * work.response_len
    if hf.mla is not None:
        widths = hf.mla.q_head_dim + hf.mla.v_head_dim
    else:
        widths = 2 * hf.head_dim
    attention = 2 * (mean_len / 2) * hf.num_attention_heads * widths * hf.num_layers
    return 2 * active_param_count(hf, head=head) + attention


def train_seconds(models: Models, gpu: GPUSpec, work: Workload, ranks: int) -> float:
    """Estimated training time of one step (scoring pass and updates of every model in
    ``models``) on ``ranks`` ranks (module doc)."""
    flops = 0.0
    for head, (hf, layout) in models.items():
        recompute = work.policy_recompute if head == "lm" else work.critic_recompute
        share = recompute_share(recompute, hf.num_layers // layout.pp)
        passes = 1 + work.ppo_epochs * (3 + share)
        flops += passes * forward_flops_per_token(hf, work, head=head) * step_tokens(work)
    return flops / (ranks * gpu.bf16_flops * TRAIN_MFU)


def tail_seconds(hf: HFModelConfig, gpu: GPUSpec, result: Decode, work: Workload) -> float:
    """The step's last wave past the mean response: (longest - mean) decode steps of one
    sequence (module doc); 0 when nothing can be generated."""
    if not math.isfinite(result.seconds):
        return 0.0
    one = decode(
        hf, gpu, result.layout, work, ranks=result.layout.tp, kv_cache=result.kv_cache, samples=1
    )
    mean = work.response_len * work.mean_response_fraction
    return one.seconds / mean * (work.response_len - mean)


def weight_transfer_seconds(hf: HFModelConfig) -> float:
    """The policy's bf16 weights (as vLLM loads them) at WEIGHT_TRANSFER_BYTES_PER_S."""
    return vllm_weight_bytes(hf, RolloutLayout()) / WEIGHT_TRANSFER_BYTES_PER_S


@dataclass(frozen=True, kw_only=True)
class Colocated:
    """The synchronous step of a colocated plan (estimated)."""

    plan: mp.Plan
    decode: Decode
    tail_seconds: float
    train_seconds: float
    switch_seconds: float
    """The training state to the host and back around the rollout (0 without offload)."""

    @property
    def rollout_seconds(self) -> float:
        return self.decode.seconds + self.tail_seconds

    @property
    def step_seconds(self) -> float:
        return self.rollout_seconds + self.train_seconds + self.switch_seconds


def colocated_step(
    result: mp.Plan, models: Models, layout: RolloutLayout | None = None
) -> Colocated:
    """The synchronous step of ``result`` (a colocated plan of ``models``); ``layout``: vLLM
    laid out so instead of the plan's TP (the same memory share, its KV cache what the
    layout's weights leave), to compare placements at one rollout layout."""
    work, gpu = result.workload, result.gpu
    switch = 0.0
    if work.offload == "rollout":
        state = sum(m.params + m.optimizer for m in (result.policy_memory, result.critic_memory)
                    if m is not None)  # fmt: skip
        switch = 2 * state / HOST_COPY_BYTES_PER_S
    rollout = result.decode()
    if layout is not None:
        kv = result.kv_cache + result.vllm_weights - vllm_weight_bytes(result.hf, layout)
        rollout = decode(result.hf, gpu, layout, work, ranks=work.world_size, kv_cache=max(kv, 0))
    return Colocated(plan=result, decode=rollout, tail_seconds=tail_seconds(result.hf, gpu,
                     rollout, work), train_seconds=train_seconds(models, gpu, work,
                     work.world_size), switch_seconds=switch)  # fmt: skip


def rollout_rank_kv(hf: HFModelConfig, gpu: GPUSpec, layout: RolloutLayout,
                    work: Workload) -> tuple[float, int]:  # fmt: skip
    """(gpu_memory_utilization, KV-cache bytes) of a rollout-only rank (module doc): vLLM
    takes what the reserve, the headroom, one sync message and the held layer leave."""
    communicators = 2 + (layout.tp > 1) + (layout.dp > 1)  # world, transfer, TP, EP
    reserve = mp.CUDA_CONTEXT + communicators * mp.NCCL_PER_COMMUNICATOR + work.reserve_bytes
    held = mp.SYNC_BUCKET + mp.sync_hold_bytes(hf, layout.ranks)
    budget = gpu.memory_bytes - work.min_headroom_bytes - reserve - held
    graphs = 0 if work.enforce_eager else mp.VLLM_CUDA_GRAPHS
    kv = budget - vllm_weight_bytes(hf, layout) - mp.VLLM_OVERHEAD - graphs
    return math.floor(100 * budget / gpu.memory_bytes) / 100, max(kv, 0)


def rollout_layouts(hf: HFModelConfig, ranks: int, gpus_per_node: int,
                    *, tp_only: bool = False) -> Iterator[RolloutLayout]:  # fmt: skip
    """Replica layouts that divide ``ranks``: vLLM TP inside a node (the heads' rule); for an
    MoE model (unless ``tp_only``) also data-parallel attention over dp groups of TP, the
    experts over the replica's tp x dp ranks (dividing the experts), up to 64 ranks."""
    tps = [t for t in (1, 2, 4, 8, 16) if t <= gpus_per_node]
    for tp in tps:
        if mp.rollout_tp_problems(hf, tp, ranks):
            continue
        yield RolloutLayout(tp=tp)
        if not hf.is_moe or tp_only:
            continue
        for dp in (2, 4, 8, 16, 32, 64):
            size = tp * dp
            if size <= min(ranks, 64) and ranks % size == 0 and hf.num_experts % size == 0:
                yield RolloutLayout(tp=tp, dp=dp)


def fastest_rollout(
    hf: HFModelConfig,
    gpu: GPUSpec,
    work: Workload,
    ranks: int,
    *,
    tp_only: bool = False,
    layout: RolloutLayout | None = None,
) -> tuple[Decode, float] | None:
    """(the fastest rollout on ``ranks`` rollout-only ranks, its tail seconds), over
    :func:`rollout_layouts` (``layout``: that one only); None when no layout holds one
    sequence per group."""
    best = None
    layouts = [layout] if layout else rollout_layouts(hf, ranks, work.gpus_per_node,
                                                      tp_only=tp_only)  # fmt: skip
    for candidate in layouts:
        _, kv = rollout_rank_kv(hf, gpu, candidate, work)
        result = decode(hf, gpu, candidate, work, ranks=ranks, kv_cache=kv)
        if result.sequences_per_group < 1:
            continue
        total = (result, tail_seconds(hf, gpu, result, work))
        if best is None or sum_seconds(total) < sum_seconds(best):
            best = total
    return best


def sum_seconds(rollout: tuple[Decode, float]) -> float:
    return rollout[0].seconds + rollout[1]


def trainer_plan(
    hf: HFModelConfig,
    gpu: GPUSpec,
    policy: ModelLayout,
    critic: ModelLayout | None,
    work: Workload,
    *,
    critic_hf: HFModelConfig | None = None,
) -> mp.Plan:
    """Memory of the trainer ranks of a separate placement (``work.world_size`` = T): no vLLM
    and nothing offloaded; the weight sync holds the training state and one message it sends.
    The plan's vLLM fields are 0."""
    idle = replace(work, gpu_memory_utilization=0.0, offload="none", rollout_tp=1,
                   sleep_level=2, enforce_eager=True)  # fmt: skip
    result = mp.plan(hf, gpu, policy, critic, idle, critic_hf=critic_hf)
    if not result.phases:
        return result
    reserve = sum(result.reserve.values())
    resident = result.policy_memory.state + (result.critic_memory.state
                                             if result.critic_memory else 0)  # fmt: skip
    phases = {name: need for name, need in result.phases.items() if name.endswith("_update")}
    phases["weight_sync"] = resident + mp.SYNC_BUCKET + reserve
    problems = [p for p in result.problems if not p.startswith("vLLM at TP")]
    problems = [p for p in problems if not p.startswith(("rollout needs", "weight_sync needs"))]
    problems += [p for p in mp.memory_problems(phases, gpu, idle) if p.startswith("weight_sync")]
    return replace(result, phases=phases, problems=problems, vllm_weights=0, kv_cache=0,
                   sync_hold=0)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Separate:
    """One split of N ranks into R rollout ranks and T trainer ranks (estimated)."""

    rollout_ranks: int
    trainer: mp.Plan
    """The trainer ranks' memory (:func:`trainer_plan`, world T)."""
    decode: Decode
    tail_seconds: float
    utilization: float
    """gpu_memory_utilization of a rollout rank."""
    train_seconds: float
    transfer_seconds: float

    @property
    def trainer_ranks(self) -> int:
        return self.trainer.workload.world_size

    @property
    def rollout_seconds(self) -> float:
        return self.decode.seconds + self.tail_seconds

    @property
    def step_seconds(self) -> float:
        return max(self.train_seconds, self.rollout_seconds) + self.transfer_seconds

    @property
    def wait_seconds(self) -> float:
        """How long the faster side waits for the other each step."""
        return abs(self.train_seconds - self.rollout_seconds)


def fitting_trainer(
    models: Models, gpu: GPUSpec, work: Workload, *, search: bool
) -> mp.Plan | None:
    """The trainer ranks' plan at ``work.world_size`` (T) with ``models``' layouts when they
    fit, else (``search``) with the first pair of the planner's layout search that fits
    (``memory.layout_pairs``, best first); None when none does."""
    hf, policy = models["lm"]
    critic_hf, critic = models.get("value", (None, None))
    own = None if critic_hf is hf else critic_hf
    if not any(mp.layout_problems(m, lay, work.world_size) for m, lay in models.values()):
        result = trainer_plan(hf, gpu, policy, critic, work, critic_hf=own)
        if result.fits:
            return result
    if not search:
        return None
    for pol, cri in mp.layout_pairs(hf, gpu, work, work.gpus_per_node, own):
        result = trainer_plan(hf, gpu, pol, cri, work, critic_hf=own)
        if result.fits:
            return result
    return None


def separate_step(
    models: Models,
    gpu: GPUSpec,
    work: Workload,
    rollout_ranks: int,
    *,
    tp_only: bool = False,
    search: bool = True,
    layout: RolloutLayout | None = None,
) -> Separate | None:
    """The overlapped step of ``work.world_size`` ranks of which ``rollout_ranks`` generate,
    with the fastest rollout layout (``tp_only``: vLLM TP replicas only, what the trainer runs
    today) and ``models``' training layouts, or (``search``) the planner's first pair that fits
    T ranks; ``layout``: the rollout ranks' vLLM layout as given (a recipe's); None when no
    layout fits the trainer ranks, or no rollout layout holds a sequence."""
    hf = models["lm"][0]
    if not 0 < rollout_ranks < work.world_size:
        return None
    trainers = replace(work, world_size=work.world_size - rollout_ranks)
    trainer = fitting_trainer(models, gpu, trainers, search=search)
    rollout = fastest_rollout(hf, gpu, work, rollout_ranks, tp_only=tp_only, layout=layout)
    if trainer is None or rollout is None:
        return None
    trained: Models = {"lm": (hf, trainer.policy)}
    if trainer.critic is not None:
        trained["value"] = (models["value"][0], trainer.critic)
    util, _ = rollout_rank_kv(hf, gpu, rollout[0].layout, work)
    return Separate(rollout_ranks=rollout_ranks, trainer=trainer, decode=rollout[0],
                    tail_seconds=rollout[1], utilization=util,
                    train_seconds=train_seconds(trained, gpu, trainers, trainers.world_size),
                    transfer_seconds=weight_transfer_seconds(hf))  # fmt: skip


def best_split(
    models: Models, gpu: GPUSpec, work: Workload, *, tp_only: bool = False
) -> Separate | None:
    """The split whose overlapped step is shortest (module doc): rollout ranks in whole
    nodes, the trainer ranks' layouts as given or searched (:func:`separate_step`); None when
    no split fits."""
    best = None
    for ranks in range(work.gpus_per_node, work.world_size, work.gpus_per_node):
        split = separate_step(models, gpu, work, ranks, tp_only=tp_only)
        if split is not None and (best is None or split.step_seconds < best.step_seconds):
            best = split
    return best
