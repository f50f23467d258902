"""What one step asks of every GPU (:class:`Workload`), from the planner's flags or from a
recipe (:func:`planner_workload`: what ``tools/plan.py --recipe`` and the dry run plan)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # only read: planning a recipe needs no config code at import
    from vapo_megatron.config.train import TrainConfig
    from vapo_megatron.models.config import Head

GIB = 1 << 30

Offload = Literal["none", "optimizer", "rollout"]
OFFLOADS: dict[str, str] = {
    "none": "everything resident (rollout.offload_training_state=false)",
    "optimizer": "Adam state on the host, step on the CPU (megatron-core optimizer_cpu_offload; "
    "planning only: not wired into the trainer)",
    "rollout": "both models' params and Adam state on the host, grads dropped, while vLLM "
    "starts and is awake (rollout.offload_training_state=true)",
}
Recompute = tuple[str | None, str | None, int | None]
"""(granularity, method, num_layers), as ``RecomputeSettings`` in a recipe."""
NO_RECOMPUTE: Recompute = (None, None, None)
FULL_RECOMPUTE: Recompute = ("full", "uniform", 1)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one step asks of every GPU (from a recipe or the planner's flags)."""

    world_size: int
    """Ranks (GPUs) of the job."""
    prompt_len: int
    """Longest prompt (data.max_prompt_tokens)."""
    response_len: int
    """Longest response (rollout.max_new_tokens)."""
    micro_batch_tokens: int
    """Token budget of one packed micro-batch per DP replica (trainer.micro_batch_tokens)."""
    bf16: bool = True
    """bf16 training parameters with fp32 grads and Adam (else all fp32)."""
    distributed_optimizer: bool = True
    """Shard the policy's Adam state over the DP x CP ranks (policy.optim)."""
    critic_distributed_optimizer: bool | None = None
    """The same for the critic (critic.optim); None: as the policy."""
    policy_recompute: Recompute = NO_RECOMPUTE
    """The policy's activation recompute (recipe policy.recompute)."""
    critic_recompute: Recompute = NO_RECOMPUTE
    """The critic's activation recompute (recipe critic.recompute)."""
    grad_reduce_in_fp32: bool = True
    """fp32 gradient buffers (recipe gpu.grad_reduce_in_fp32; auto: on for bf16)."""
    uses_critic: bool = True
    """A critic trains next to the policy (GRPO/DAPO: no)."""
    rollout_tp: int = 1
    """vLLM tensor parallelism per engine replica."""
    gpu_memory_utilization: float = 0.5
    """Share of device memory vLLM takes when awake."""
    offload: Offload = "none"
    """What leaves the device, and when (OFFLOADS)."""
    enforce_eager: bool = False
    """vLLM without CUDA graphs (rollout.enforce_eager)."""
    sleep_level: int = 2
    """vLLM's sleep level (rollout.sleep_level): 1 keeps a pinned host copy of its weights."""
    checkpoint_async: bool = False
    """Background checkpoint saves (trainer.checkpoint_async): both models staged at once."""
    gpus_per_node: int = 8
    """GPUs (ranks) per node: the per-node pinned host memory."""
    reserve_bytes: int = 2 * GIB
    """Per-GPU allocator fragmentation and what nothing else counts (besides the CUDA context
    and NCCL buffers, which reserve_parts adds)."""
    min_headroom_bytes: int = 8 * GIB
    """Memory every phase must leave free."""
    samples_per_step: int = 512 * 16
    """Responses generated per step (algorithm.prompts_per_step x samples_per_prompt)."""
    mean_response_fraction: float = 0.5
    """Mean response length over the longest (for the rollout time; an estimate)."""
    routing_replay: bool = False
    """The policy replays the engine's routes (algorithm.routing_replay: rollout; MoE)."""
    critic_routing_replay: bool = False
    """An MoE critic replays its scoring pass's routes (critic.routing_replay: scoring)."""
    ppo_epochs: int = 1
    """Passes of updates over the step's samples (trainer.ppo_epochs; the training time)."""
    policy_mtp: bool = False
    """The policy's multi-token-prediction layers are built and trained on its last stage
    (policy.mtp.loss_weight > 0); False: carried as files, not counted."""

    def builds_mtp(self, head: Head) -> bool:
        """Whether the model with ``head`` builds MTP layers (a critic never does)."""
        return head == "lm" and self.policy_mtp

    @property
    def sequence_len(self) -> int:
        return self.prompt_len + self.response_len


def planner_workload(config: TrainConfig, world_size: int) -> Workload:
    """The planner's workload for a recipe: what ``tools/plan.py --recipe`` plans."""
    bf16 = config.model.dtype == "bfloat16"
    grad_fp32 = config.gpu.grad_reduce_in_fp32
    as_tuple = lambda r: (r.granularity, r.method, r.num_layers)  # noqa: E731
    return Workload(
        world_size=world_size,
        prompt_len=config.data.max_prompt_tokens,
        response_len=config.rollout.max_new_tokens,
        micro_batch_tokens=config.trainer.micro_batch_tokens,
        bf16=bf16,
        distributed_optimizer=config.policy.optim.distributed_optimizer,
        critic_distributed_optimizer=config.critic.optim.distributed_optimizer,
        policy_mtp=config.policy.mtp.trained,
        uses_critic=config.algorithm.uses_critic,
        policy_recompute=as_tuple(config.policy.recompute),
        critic_recompute=as_tuple(config.critic.recompute),
        grad_reduce_in_fp32=bf16 if grad_fp32 == "auto" else bool(grad_fp32),
        rollout_tp=config.rollout.tensor_parallel_size,
        gpu_memory_utilization=config.rollout.gpu_memory_utilization,
        offload="rollout" if config.rollout.offload_training_state else "none",
        enforce_eager=config.rollout.enforce_eager,
        sleep_level=config.rollout.sleep_level,
        checkpoint_async=config.trainer.checkpoint_async,
        samples_per_step=config.algorithm.prompts_per_step * config.algorithm.samples_per_prompt,
        routing_replay=config.algorithm.routing_replay == "rollout",
        critic_routing_replay=config.critic.routing_replay == "scoring",
        ppo_epochs=config.trainer.ppo_epochs,
    )
