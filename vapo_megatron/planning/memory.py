"""Per-GPU memory of a colocated VAPO job (policy + critic + vLLM on every GPU), by phase.

The model behind ``tools/plan.py``. Every figure is labelled in its output as one of:

- **exact**: parameter counts. :func:`shard_param_count` gives the parameters one rank of a
  megatron-core ``GPTModel`` holds at a TP/PP/EP layout (checked against real CPU builds in
  ``tests/unit/planning/test_memory_plan.py``, MoE ones against meta builds in
  ``test_moe_plan.py``), so params, grads and Adam state are exact counts times
  their byte sizes: bf16 params 2 B; grads 4 B with ``grad_reduce_in_fp32`` (the recipe's
  ``gpu.grad_reduce_in_fp32``; auto = on for bf16), else 2 B; Adam 12 B (fp32 main copy + two
  moments) divided, under the distributed optimizer, by the DP x CP ranks for dense
  parameters and by the expert-DP ranks (world / (ETP x EP x PP)) for expert ones
  (``planning/params.py``). fp32 training: 4 + 4
  + 8 B. The dry run (``planning/dry_run.py``) reads the same figures from the objects megatron
  builds at the real layout: equal, except that the distributed optimizer pads each DDP bucket
  to a multiple of lcm(DP x CP, 128) elements and shards along bucket boundaries (zero
  difference at the recipes' DP x CP = 16; +1.5 KB of grads and a few KB of optimizer per rank
  at DP x CP = 12). Checkpoint bytes per rank: :func:`checkpoint_bytes`.
- **measured** (on CPU, ``tests/unit/models/test_logprobs_chunked.py``): the log-prob / entropy
  work on the policy's logits. ``models/logprobs.py`` keeps the bf16 logits for backward and
  writes a bf16 gradient of the same size (4 B per logit element over a micro-batch's tokens x
  the local vocabulary) plus the fp32 temporaries of one chunk (16 B x
  ``LOGPROB_CHUNK_TOKENS`` x local vocabulary). Before chunking it measured 25.6 B per element.
- **estimated**: everything else, written down here so it can be checked and corrected.
  Activations saved for backward, per token and layer, bf16 (flash/fused attention, no s^2
  term): norm and projection inputs 4h, q + k + v + attention output, fc1 output 2f (SwiGLU
  keeps both halves), fc2 input f; all divided by TP under sequence parallelism (without it,
  the 4h part is not). K/V received from the CP ring add (cp - 1) x k + v. Tokens per GPU:
  ``max(micro_batch_tokens, longest sample) / cp``. 1F1B keeps pp micro-batches in flight on
  the first stage; the interleaved schedule adds (pp - 1) / (pp * vpp). Recompute as each
  model's recipe sets it: selective drops only the s^2 scores (none counted here); full keeps
  each recomputed group's input (2h per token) and, during its backward, the group's full
  activations (uniform: num_layers layers; block: the first num_layers layers of a stage
  recomputed, the rest stored). One more layer's worth is live during its backward. MoE
  layers: the router's probabilities, top-k routed rows per token through the experts and
  the all-to-all dispatch buffers (``planning/activations.py``).
  vLLM when awake takes ``gpu_memory_utilization`` of the device: its weight shard (bf16 over
  vLLM TP, exact), ``VLLM_OVERHEAD`` (profile-run activations, sampler) and, without
  ``enforce_eager``, ``VLLM_CUDA_GRAPHS`` (vLLM >= 0.11 profiles the graph pool inside its
  budget); the KV cache is the rest. An MoE model's experts are split over the replica's ranks
  either way (vLLM TP shards each expert, ``enable_expert_parallel`` gives each rank
  experts / TP whole ones): the same bytes per rank. Asleep it holds nothing on the device (level 1 keeps a
  host copy of the weights, level 2 nothing). Outside every count, a reserve per GPU: the CUDA
  context, NCCL buffers per communicator in use, and allocator fragmentation
  (``reserve_parts``). Rollout time: ``planning/vllm.py::decode`` (memory- or compute-bound decode steps
  plus the collectives' latency; ``rollout_seconds``); MLA's KV cache is its compressed kv
  and RoPE key, whole on every vLLM TP rank. The weight sync: one
  message in flight (``SYNC_BUCKET``) and what vLLM holds while a module loads
  (:func:`sync_hold_bytes`: a whole MoE layer's experts as full HF tensors).

Each model is planned from its own config: the critic's (``critic.model``, a preset or an HF
directory, ``weights/critic.py::critic_model_config``) may be another size or family than
the policy's; the weight sync, vLLM and the policy's logits read the policy's.

Training state and offload: with ``rollout.offload_training_state`` (``offload="rollout"``) the
trainer moves both models' params and Adam state to the host and drops their grads before vLLM
starts and while it is awake (``rollout/sleep_state.py``): the rollout phase holds none of it,
the weight sync only the policy's parameters. vLLM's sleep takes its CUDA-graph pool and its
"runtime" pool to the host too (``sleep_mode_offload_cudagraph``, ``rollout/engine.py``); both
come back with the weights' wake, so the weight sync holds them. Every phase must leave
``min_headroom_bytes`` free.

Pinned host memory per GPU (:func:`pinned_parts`, ``Plan.pinned``), every part labelled:
the offloaded training state (exact: one arena of exactly params + Adam bytes, page-locked in
place, ``engine/host_arena.py``); megatron's checkpoint staging (estimated: its save copies
the rank's share to the host with ``non_blocking=True``, which pins through torch's caching host
allocator, sync saves as well as async ones; each tensor rounds up to a power of two, and the
blocks stay cached for the rest of the run; async saves stage both models at once, sync saves
one part at a time, reusing the blocks); vLLM's sleep backups (estimated: ``CuMemAllocator``
copies each offloaded allocation into ``torch.empty(..., pin_memory=True)``, power-of-two
rounded: the weights at level 1, the runtime pool and the CUDA-graph pool at every level).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.models.config import Head, HFModelConfig
from vapo_megatron.planning.activations import activation_bytes
from vapo_megatron.planning.host import (
    VLLM_CUDA_GRAPHS,
    VLLM_RUNTIME_POOL,
    Models,
    PinnedPart,
    distributed_optimizer,
    pinned_parts,
)
from vapo_megatron.planning.params import shard_param_split
from vapo_megatron.planning.presets import GPUSpec
from vapo_megatron.planning.vllm import (
    Decode,
    RolloutLayout,
    decode,
    kv_bytes_per_token,
    vllm_weight_bytes,
)
from vapo_megatron.planning.workload import GIB, Workload

VLLM_OVERHEAD = int(1.5 * GIB)
"""vLLM's non-KV memory besides weights and CUDA graphs on one GPU: activations of its profile
run, sampler (an estimate; vLLM measures it at start)."""
CUDA_CONTEXT = int(0.6 * GIB)
"""CUDA context and kernels' modules per process (an estimate)."""
NCCL_PER_COMMUNICATOR = GIB // 4
"""Buffers of one NCCL communicator (channels x peers x NCCL_BUFFSIZE; an estimate)."""
SYNC_BUCKET = 256 << 20
"""rollout.weight_bucket_bytes default: extra memory of one weight-sync message."""


@dataclass(frozen=True, kw_only=True)
class ModelMemory:
    """One model's per-GPU bytes on its largest pipeline stage."""

    params: int
    grads: int
    optimizer: int
    activations: int
    """Saved for backward in its update, plus the live layer and (policy) the logits."""

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Memory of one layout by phase, and whether it fits."""

    gpu: GPUSpec
    policy: ModelLayout
    critic: ModelLayout | None
    workload: Workload
    hf: HFModelConfig
    """The policy's model (what vLLM serves)."""
    policy_memory: ModelMemory
    critic_memory: ModelMemory | None
    phases: dict[str, int]
    """Per-GPU peak bytes of each phase: rollout, weight_sync, policy_update, critic_update."""
    vllm_weights: int
    """bf16 weight shard of one vLLM rank."""
    kv_cache: int
    """KV cache bytes of one vLLM rank when awake."""
    kv_bytes_per_token: int
    """KV bytes per token on one vLLM rank."""
    problems: list[str]
    """Why it does not divide or fit; empty when it fits."""
    reserve: dict[str, int]
    """The per-GPU reserve by part (reserve_parts), included in every phase."""
    pinned: dict[str, PinnedPart]
    """Pinned host memory per GPU by part (pinned_parts)."""
    sync_hold: int
    """Bytes vLLM holds while its largest module loads in the weight sync (sync_hold_bytes),
    included in the weight_sync phase."""

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def host_bytes(self) -> int:
        """Pinned host memory per GPU, every part (``pinned``) together."""
        return sum(part.nbytes for part in self.pinned.values())

    @property
    def host_bytes_per_node(self) -> int:
        return self.host_bytes * self.workload.gpus_per_node

    @property
    def headroom(self) -> int:
        """Memory the fullest phase leaves free."""
        return self.gpu.memory_bytes - self.peak

    @property
    def rollout_seconds(self) -> float:
        """Estimated generation time of one step: every rank generates, in replicas of vLLM
        TP (``planning/vllm.py::decode``: memory- or compute-bound decode plus the
        collectives' latency)."""
        return self.decode().seconds

    def decode(self) -> Decode:
        """The rollout estimate of this colocated plan (``planning/vllm.py::decode``)."""
        work = self.workload
        return decode(
            self.hf,
            self.gpu,
            RolloutLayout(tp=work.rollout_tp),
            work,
            ranks=work.world_size,
            kv_cache=self.kv_cache,
        )

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def concurrent_sequences(self) -> float:
        """Full-length sequences one vLLM replica's KV cache holds at once."""
        return self.kv_cache / (self.kv_bytes_per_token * self.workload.sequence_len)


def layout_problems(hf: HFModelConfig, layout: ModelLayout, world_size: int) -> list[str]:
    """Why ``layout`` cannot run ``hf`` on ``world_size`` ranks (the trainer's own checks)."""
    from vapo_megatron.config.layout import layout_sizes

    problems = []
    for check in (lambda: layout.check(hf), lambda: layout_sizes(
            tp=layout.tp, pp=layout.pp, cp=layout.cp, world_size=world_size, ep=layout.ep,
            etp=layout.etp)):  # fmt: skip
        try:
            check()
        except ValueError as err:
            problems.append(str(err))
    return problems


def rollout_tp_problems(hf: HFModelConfig, rollout_tp: int, world_size: int) -> list[str]:
    """vLLM shards query heads over TP and replicates KV heads when TP exceeds them."""
    kv = hf.num_key_value_heads
    if world_size % rollout_tp:
        return [f"vLLM TP {rollout_tp} does not divide the world size {world_size}"]
    if hf.num_attention_heads % rollout_tp or (kv % rollout_tp and rollout_tp % kv):
        return [
            f"vLLM TP {rollout_tp} must divide num_attention_heads={hf.num_attention_heads}, "
            f"and num_key_value_heads={kv} must be a multiple or a divisor of it"
        ]
    return []


def context_problems(hf: HFModelConfig, work: Workload) -> list[str]:
    """The model's context must hold the longest prompt and response (vLLM's max_model_len
    and the critic's check, issue 28)."""
    if work.sequence_len <= hf.max_position_embeddings:
        return []
    return [
        f"max_position_embeddings={hf.max_position_embeddings} is shorter than the longest "
        f"prompt + response ({work.prompt_len} + {work.response_len} = {work.sequence_len} "
        "tokens); lower data.max_prompt_tokens or rollout.max_new_tokens, or take a model with "
        "a longer context"
    ]


def stage_state(
    hf: HFModelConfig, layout: ModelLayout, work: Workload, *, head: Head, pp_rank: int
) -> ModelMemory:
    """Params, grads and Adam bytes of one rank at ``pp_rank`` (activations 0): exact counts
    times byte sizes (module doc); ``planning/dry_run.py`` sets them beside the built objects'.
    Adam: dense parameters sharded over DP x CP, expert ones over expert DP."""
    mtp = work.builds_mtp(head)
    dense, expert = shard_param_split(hf, layout, head=head, pp_rank=pp_rank, mtp=mtp)
    params = dense + expert
    param_bytes = 2 if work.bf16 else 4
    adam_bytes = 12 if work.bf16 else 8
    dense_shards = expert_shards = 1
    if distributed_optimizer(work, head):
        dense_shards = work.world_size // (layout.tp * layout.pp)
        expert_shards = work.world_size // (layout.expert_tp * layout.ep * layout.pp)
    grad_bytes = 4 if work.grad_reduce_in_fp32 or not work.bf16 else 2
    optimizer = math.ceil(dense * adam_bytes / dense_shards)
    optimizer += math.ceil(expert * adam_bytes / expert_shards)
    return ModelMemory(
        params=params * param_bytes,
        grads=params * grad_bytes,
        optimizer=optimizer,
        activations=0,
    )


def model_memory(
    hf: HFModelConfig, layout: ModelLayout, work: Workload, *, head: Head
) -> ModelMemory:
    """Per-GPU bytes of one model on its largest stage (see the module doc for each term)."""
    stages = [stage_state(hf, layout, work, head=head, pp_rank=r) for r in range(layout.pp)]
    largest = max(stages, key=lambda stage: stage.params)
    return replace(largest, activations=activation_bytes(hf, layout, work, head=head))


def reserve_parts(
    policy: ModelLayout, critic: ModelLayout | None, work: Workload
) -> dict[str, int]:
    """The per-GPU memory no tensor count sees, by part (estimates): the CUDA context, NCCL
    buffers of each communicator a rank uses (per model TP, CP, DP x CP and model-parallel
    when larger than 1, PP p2p, EP and expert DP (and expert TP when it is not TP) under expert
    parallelism; the world; vLLM's TP group and its world), fragmentation."""
    communicators = 2  # the world (barriers, broadcasts) and vLLM's world
    for layout in (lay for lay in (policy, critic) if lay is not None):
        sizes = [layout.tp, layout.cp, work.world_size // (layout.tp * layout.pp),
                 layout.tp * layout.pp, layout.pp]  # fmt: skip
        if layout.ep > 1:
            etp = layout.expert_tp
            sizes += [layout.ep, work.world_size // (etp * layout.ep * layout.pp)]
            sizes += [etp] if etp != layout.tp else []
        communicators += sum(1 for size in sizes if size > 1)
    communicators += work.rollout_tp > 1
    return {
        "cuda_context": CUDA_CONTEXT,
        "nccl": communicators * NCCL_PER_COMMUNICATOR,
        "fragmentation": work.reserve_bytes,
    }


def check_models(models: Models, work: Workload) -> list[str]:
    """Each model's layout and context problems, then vLLM's (the policy's model)."""
    problems = []
    for head, (hf, layout) in models.items():
        role = "policy" if head == "lm" else "critic"
        problems += [f"{role}: {p}" for p in layout_problems(hf, layout, work.world_size)]
        problems += [f"{role}: {p}" for p in context_problems(hf, work)]
    return problems + rollout_tp_problems(models["lm"][0], work.rollout_tp, work.world_size)


def plan(
    hf: HFModelConfig,
    gpu: GPUSpec,
    policy: ModelLayout,
    critic: ModelLayout | None,
    work: Workload,
    *,
    critic_hf: HFModelConfig | None = None,
) -> Plan:
    """Per-phase per-GPU memory of this layout pair; ``problems`` says what does not fit.
    ``critic_hf``: the critic's own model (None: the policy's)."""
    models: Models = {"lm": (hf, policy)}
    if critic is not None:
        models["value"] = (critic_hf or hf, critic)
    problems = check_models(models, work)
    if problems:  # the memory of a layout that cannot be built means nothing
        empty = ModelMemory(params=0, grads=0, optimizer=0, activations=0)
        return Plan(gpu=gpu, policy=policy, critic=critic, workload=work, hf=hf,
                    policy_memory=empty,
                    critic_memory=None, phases={}, vllm_weights=0, kv_cache=0,
                    kv_bytes_per_token=1, problems=problems, reserve={}, pinned={},
                    sync_hold=0)  # fmt: skip
    memory = {head: model_memory(m, lay, work, head=head) for head, (m, lay) in models.items()}
    pol, cri = memory["lm"], memory.get("value")
    resident = sum(m.state for m in memory.values())
    if work.offload == "optimizer":
        resident -= sum(m.optimizer for m in memory.values())
    during_rollout, during_sync = resident, resident
    if work.offload == "rollout":  # all off while vLLM is awake; the sync reads policy params
        during_rollout, during_sync = 0, pol.params
    vllm_budget = int(work.gpu_memory_utilization * gpu.memory_bytes)
    vllm_weights = vllm_weight_bytes(hf, RolloutLayout(tp=work.rollout_tp))
    kv_per_token = kv_bytes_per_token(hf, work.rollout_tp)
    graphs = 0 if work.enforce_eager else VLLM_CUDA_GRAPHS
    kv_cache = vllm_budget - vllm_weights - VLLM_OVERHEAD - graphs
    sync_hold = sync_hold_bytes(hf, work.rollout_tp)
    # The weights' wake brings back every pool vLLM's sleep took that is not deferred: the
    # runtime pool and the CUDA graphs (vLLM 0.32 ``CuMemAllocator.wake_up``).
    vllm_at_sync = vllm_weights + VLLM_RUNTIME_POOL + graphs
    phases = {
        "rollout": during_rollout + vllm_budget,
        "weight_sync": during_sync + vllm_at_sync + SYNC_BUCKET + sync_hold,
        "policy_update": resident + pol.activations,
    }
    if cri is not None:
        phases["critic_update"] = resident + cri.activations
    reserve = reserve_parts(policy, critic, work)
    phases = {name: b + sum(reserve.values()) for name, b in phases.items()}
    problems = memory_problems(phases, gpu, work)
    if kv_cache < kv_per_token * work.sequence_len:
        problems.append(
            f"vLLM at TP {work.rollout_tp} with gpu_memory_utilization="
            f"{work.gpu_memory_utilization:.2f} has {max(kv_cache, 0) / GIB:.1f} GiB of KV cache "
            f"per GPU, less than one {work.sequence_len}-token sequence "
            f"({kv_per_token * work.sequence_len / GIB:.2f} GiB); raise the utilization or vLLM TP"
        )
    state = sum(m.params + m.optimizer for m in memory.values())
    return Plan(gpu=gpu, policy=policy, critic=critic, workload=work, hf=hf, policy_memory=pol,
                critic_memory=cri, phases=phases, vllm_weights=vllm_weights,
                kv_cache=max(kv_cache, 0), kv_bytes_per_token=kv_per_token,
                problems=problems, reserve=reserve,
                pinned=pinned_parts(models, work, state), sync_hold=sync_hold)  # fmt: skip


def sync_hold_bytes(hf: HFModelConfig, rollout_tp: int) -> int:
    """What one vLLM rank holds during the weight sync while its largest module loads, beyond
    the message in flight (estimated; read in vLLM 0.32, ``model_loader/reload/layerwise.py``).

    Under layerwise reload each module's loader call is buffered with its arguments
    (``make_online_process_loader``: ``info.loaded_weights``), so every tensor sent to a module
    stays referenced until the module's last element arrives; then ``_layerwise_process``
    materializes the module's parameters anew on the device (the rank's vLLM shard), loads the
    buffered tensors, copies the result into the live parameters and lets both go. The held
    tensors are the full HF tensors: vLLM's loaders take this rank's TP slice (and, under
    expert parallelism, skip another rank's experts) only when the buffered call runs. An MoE
    layer's routed experts are one module (``FusedMoE``: w13 and w2 of every expert), so the
    whole layer's experts are held, num_experts x (gate + up + down), whatever vLLM's TP or EP;
    the stream sends each layer's tensors together (``weights/stream.py``: stages, then layers,
    in order), so one layer at a time. The other candidates are the embedding (or the LM head,
    the same shape) and a dense MLP's gate + up (``gate_up_proj``). bf16; the materialized
    shard is taken as the held bytes / vLLM TP."""
    h = hf.hidden_size
    modules = [hf.padded_vocab_size(1) * h]
    if hf.is_moe:
        modules.append(hf.num_experts * 3 * h * hf.moe_intermediate_size)
    else:
        modules.append(2 * hf.intermediate_size * h)
    held = 2 * max(modules)
    return held + math.ceil(held / rollout_tp)


def memory_problems(phases: dict[str, int], gpu: GPUSpec, work: Workload) -> list[str]:
    """Each phase that leaves less than the headroom wanted."""
    problems = []
    for name, need in phases.items():
        if need + work.min_headroom_bytes > gpu.memory_bytes:
            problems.append(
                f"{name} needs {need / GIB:.1f} GiB per GPU, leaving "
                f"{(gpu.memory_bytes - need) / GIB:.1f} of the {gpu.memory_bytes / GIB:.1f} GiB "
                f"of a {gpu.name}; {work.min_headroom_bytes / GIB:.0f} GiB of headroom wanted"
            )
    return problems


def max_vllm_utilization(
    hf: HFModelConfig,
    gpu: GPUSpec,
    policy: ModelLayout,
    critic: ModelLayout | None,
    work: Workload,
    *,
    critic_hf: HFModelConfig | None = None,
) -> float:
    """The largest gpu_memory_utilization (two decimals, at most 0.9) whose rollout phase fits
    beside the training state with the headroom left; 0 when none does."""
    probe = plan(hf, gpu, policy, critic, replace(work, gpu_memory_utilization=0.0),
                 critic_hf=critic_hf)  # fmt: skip
    if not probe.phases:
        return 0.0
    free = gpu.memory_bytes - work.min_headroom_bytes - probe.phases["rollout"]
    return max(0.0, min(0.9, math.floor(100 * free / gpu.memory_bytes) / 100))


def candidate_layouts(
    hf: HFModelConfig, world_size: int, gpus_per_node: int
) -> Iterator[ModelLayout]:
    """Layouts to try, best first: fewest model-parallel ranks (most DP, least communication),
    then (MoE) the smallest EP (least all-to-all), TP inside a node before CP, CP before PP
    (no pipeline bubbles with variable-length RL batches); TP never crosses a node. Expert TP
    stays TP's (megatron's default)."""
    powers = [2**i for i in range(8)]
    eps = [e for e in powers if hf.num_experts % e == 0] if hf.is_moe else [1]
    options = []
    for tp in (t for t in powers if t <= gpus_per_node):
        for cp in powers[:5]:
            for pp in (p for p in powers[:5] if hf.num_layers % p == 0):
                for ep in eps:
                    layout = ModelLayout(tp=tp, pp=pp, cp=cp, ep=ep, sequence_parallel=tp > 1)
                    if not layout_problems(hf, layout, world_size):
                        options.append(layout)
    yield from sorted(
        options, key=lambda lay: (lay.tp * lay.pp * lay.cp, lay.ep, -lay.tp, lay.pp, lay.cp)
    )


def propose(
    hf: HFModelConfig,
    gpu: GPUSpec,
    work: Workload,
    *,
    gpus_per_node: int,
    min_concurrent: float = 4.0,
    critic_hf: HFModelConfig | None = None,
) -> Plan | None:
    """The first pair of candidate layouts that fits, with the smallest vLLM TP whose replica
    holds ``min_concurrent`` full-length sequences at the largest gpu_memory_utilization that
    fits; None when nothing fits. One model for both (``critic_hf`` None): one layout for
    both; a critic of its own: the critic's layouts are searched for each policy layout."""
    for layout, critic in layout_pairs(hf, gpu, work, gpus_per_node, critic_hf):
        util = max_vllm_utilization(hf, gpu, layout, critic, work, critic_hf=critic_hf)
        for rollout_tp in (t for t in (1, 2, 4, 8, 16) if t <= gpus_per_node):
            trial = replace(work, rollout_tp=rollout_tp, gpu_memory_utilization=util)
            result = plan(hf, gpu, layout, critic, trial, critic_hf=critic_hf)
            if result.fits and result.concurrent_sequences >= min_concurrent:
                return result
    return None


def layout_pairs(
    hf: HFModelConfig,
    gpu: GPUSpec,
    work: Workload,
    gpus_per_node: int,
    critic_hf: HFModelConfig | None,
) -> Iterator[tuple[ModelLayout, ModelLayout | None]]:
    """(policy, critic) layouts to try, best first (``propose``). With a critic of its own, a
    policy layout whose update does not fit even beside no critic is skipped, and so is each
    pair whose updates do not fit with vLLM asleep."""
    for layout in candidate_layouts(hf, work.world_size, gpus_per_node):
        if not work.uses_critic or critic_hf is None:
            yield layout, layout if work.uses_critic else None
            continue
        idle = replace(work, gpu_memory_utilization=0.0)
        if not updates_fit(plan(hf, gpu, layout, None, idle)):
            continue
        for critic in candidate_layouts(critic_hf, work.world_size, gpus_per_node):
            if updates_fit(plan(hf, gpu, layout, critic, idle, critic_hf=critic_hf)):
                yield layout, critic


def updates_fit(result: Plan) -> bool:
    """Whether the plan's layouts are valid and its update phases leave the headroom."""
    return bool(result.phases) and not any(
        p.startswith(("policy_update", "critic_update")) for p in result.problems
    )
