"""The trainer's config: one typed, nested, keyword-only dataclass tree, read from a YAML recipe.

``TrainConfig`` is what ``vapo-train RECIPE.yaml key=value ...`` resolves to (see
``recipe.py`` for loading, ``base:`` inheritance and overrides). Each field has a one-line
doc; :meth:`TrainConfig.check` refuses impossible combinations with the fix in the message
(one check per concern, in ``checks.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.config import checks
from vapo_megatron.config.gpu import GpuSettings
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.moe import MoESettings
from vapo_megatron.config.mtp import MTPSettings
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.config.recompute import RecomputeSettings


@dataclass(frozen=True, kw_only=True)
class ModelSettings:
    """The model both trainer and rollout start from."""

    path: str
    """HF directory of the initial policy: config.json, tokenizer and weights."""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Training parameter dtype (Adam keeps fp32 main weights under bf16)."""
    create_tiny: bool = False
    """Build the tiny synthetic task's model at model.path and its data at data.train_path / eval_path when absent (CPU recipes; nothing is downloaded)."""
    tiny_seed: int = 0
    """Seed of the tiny task, tokenizer and initial weights (create_tiny only)."""
    tiny_family: Literal["qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe"] = "qwen2"
    """HF model type of the tiny policy (create_tiny only; tiny/model.py TINY_FAMILIES)."""
    tiny_warmup_steps: int = 0
    """Supervised warm-up steps of the tiny policy, so RL starts from a non-zero pass rate (create_tiny only)."""
    tiny_slip_rate: float = 0.0
    """Fraction of the warm-up's worked lines whose result slips by 1 or 2 (carried on), drawn afresh each use: the policy learns the arithmetic and to slip at about that rate, which RL can remove (create_tiny only)."""
    tiny_guess_rate: float = 0.0
    """Fraction of the warm-up's solutions that are a guessed answer with no working (never right): the policy learns to guess that often, and RL to work the problems out instead (create_tiny only)."""
    tiny_num_train: int = 2000
    """Training problems of the tiny task (create_tiny only)."""
    tiny_num_eval: int = 200
    """Held-out problems of the tiny task (create_tiny only)."""


@dataclass(frozen=True, kw_only=True)
class PolicySettings:
    """The policy's layout, optimizer and optional Megatron checkpoint."""

    layout: ModelLayout = field(default_factory=ModelLayout)
    """TP/PP/CP/VPP/SP of the policy; data parallelism takes the remaining ranks."""
    optim: OptimSettings = field(default_factory=lambda: OptimSettings(lr=1e-6))
    """Adam and schedule (VAPO: lr 1e-6)."""
    load: str | None = None
    """Megatron checkpoint of the policy (tools/convert.py hf-to-mcore); None: read model.path's weights."""
    recompute: RecomputeSettings = field(default_factory=RecomputeSettings)
    """Activation recompute of the policy (off by default)."""
    moe: MoESettings = field(default_factory=MoESettings)
    """MoE policies: router losses (off), router dtype (fp32), token dispatcher (alltoall); config/moe.py says why."""
    mtp: MTPSettings = field(default_factory=MTPSettings)
    """Multi-token-prediction layers (DeepSeek-V3, GLM-4.5): frozen as files (loss_weight 0) or trained with their own loss; config/mtp.py says how."""


@dataclass(frozen=True, kw_only=True)
class CriticSettings:
    """The critic's layout, optimizer and where its weights come from."""

    layout: ModelLayout = field(default_factory=ModelLayout)
    """TP/PP/CP/VPP/SP of the critic, independent of the policy's."""
    model: str | None = None
    """The critic's own model: an HF directory (any supported family and size; the policy's tokenizer; a context covering data.max_prompt_tokens + rollout.max_new_tokens), or, for plan and dry run only, a planner preset (planning/presets.py); None: the policy's model.path. Its weights come from critic.init_path, or from this directory when it is a reward model."""
    create_tiny: bool = False
    """Write a tiny reward model at critic.model when absent: 1 layer, half the tiny policy's width, the policy's tokenizer, seeded weights (CPU recipes; nothing is downloaded)."""
    optim: OptimSettings = field(default_factory=lambda: OptimSettings(lr=2e-6))
    """Adam and schedule (VAPO: lr 2e-6)."""
    init_path: str | None = None
    """critic_init=reward_model: a critic Megatron checkpoint (convert --critic-from reward-model) or an HF *ForSequenceClassification directory, of critic.model's architecture; None: critic.model itself."""
    pretrained: str | None = None
    """A critic checkpoint saved by an earlier critic pretraining (run_dir/critic_pretrained); skips pretraining."""
    value_head_init_std: float = 0.0
    """critic_init=policy: std of the new value head's weights (0: values start at 0)."""
    recompute: RecomputeSettings = field(default_factory=RecomputeSettings)
    """Activation recompute of the critic (off by default)."""
    moe: MoESettings = field(default_factory=MoESettings)
    """MoE critics: router losses (off), router dtype (fp32), token dispatcher (alltoall); config/moe.py says why."""
    routing_replay: Literal["scoring", "none"] = "scoring"
    """MoE critics: 'scoring' records the routers' top-k in the scoring pass and replays them in every update's forward (and recompute), so the values that made the advantages and the values the loss moves come from one routing (step/critic_routes.py); 'none': each pass routes on its own. A dense critic has no router and ignores it, as it does critic.moe."""


@dataclass(frozen=True, kw_only=True)
class RolloutSettings:
    """vLLM generation during training."""

    tensor_parallel_size: int = 1
    """vLLM TP per engine replica; world_size / this many replicas generate their share each."""
    temperature: float = 1.0
    """Sampling temperature (also applied to the policy's log-probs, never to the critic)."""
    top_p: float = 1.0
    """Nucleus sampling."""
    max_new_tokens: int = 1024
    """Longest response; longer ones are cut and marked truncated."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Engine weights and activations."""
    max_model_len: int = 4096
    """Longest prompt + response the engine accepts."""
    kv_cache_bytes: int | None = None
    """KV cache per engine rank; None: 1 GiB on CPU, gpu_memory_utilization on GPU."""
    gpu_memory_utilization: float = 0.5
    """GPU only: the share of device memory vLLM may take."""
    enforce_eager: bool = True
    """Skip torch.compile / CUDA graphs (fast start; set False on GPU for speed)."""
    weight_bucket_bytes: int = 256 << 20
    """Bytes per weight-sync message (extra memory of a sync is about one bucket)."""
    sleep_level: Literal[1, 2] = 2
    """GPU: engine sleep during training. 1: weights to a pinned host copy, KV cache freed; 2: both freed (each step re-syncs anyway; the engine restores what the sync does not). CPU: order checks only."""
    offload_training_state: bool = False
    """Both models' parameters and optimizer state off the device while vLLM starts and while it is awake (one host arena, pinned on a GPU; bit-identical back), their grads dropped (back as zeros: every update zeroes them). On CPU too (an unpinned arena)."""
    logprob_gap_warn: float = 0.05
    """Warn when mean |exp(logp_vllm - logp_megatron) - 1| exceeds this (a stale or broken sync); exact at top_p = 1, top_p < 1 adds the nucleus renormalisation."""
    placement: Literal["colocated", "separate"] = "colocated"
    """'colocated': every rank generates, then trains. 'separate': `ranks` ranks only run vLLM replicas, the rest only train, and generation overlaps training (`lag` steps ahead)."""
    ranks: float = 0
    """Separate placement: how many of the job's ranks generate: a count (>= 1) or a fraction of the world (0 < x < 1). The planner's `tools/plan.py` suggests one."""
    lag: int | None = None
    """Step s (from 1) trains on samples generated by the policy after update s - 1 - lag (0: the step's own weights). None: 0 colocated, 1 separate."""

    def __post_init__(self) -> None:
        if self.placement not in ("colocated", "separate"):
            raise ValueError(
                f"rollout.placement must be 'colocated' or 'separate', got {self.placement!r}"
            )
        if self.lag is not None and (isinstance(self.lag, bool) or self.lag < 0):
            raise ValueError(f"rollout.lag must be an integer >= 0 or null, got {self.lag!r}")
        if self.placement == "colocated" and self.ranks:
            raise ValueError(
                f"rollout.ranks={self.ranks} names rollout ranks of their own; "
                "set rollout.placement=separate, or drop rollout.ranks"
            )
        if self.placement == "separate" and not (
            0 < self.ranks < 1 or (self.ranks >= 1 and float(self.ranks).is_integer())
        ):
            raise ValueError(
                f"rollout.placement=separate needs rollout.ranks: a whole count >= 1 or a fraction "
                f"of the world in (0, 1); got {self.ranks!r}"
            )

    @property
    def steps_behind(self) -> int:
        """The lag k actually used: step s trains on samples of the policy after update s - k."""
        if self.lag is not None:
            return self.lag
        return 1 if self.placement == "separate" else 0

    def rollout_world(self, world_size: int) -> int:
        """How many of `world_size` ranks generate (0: colocated, every rank does both)."""
        if self.placement == "colocated":
            return 0
        count = round(self.ranks * world_size) if self.ranks < 1 else int(self.ranks)
        if not 1 <= count < world_size:
            raise ValueError(
                f"rollout.ranks={self.ranks} gives {count} rollout ranks of {world_size}: "
                "at least one rank must generate and one must train"
            )
        if count % self.tensor_parallel_size:
            raise ValueError(
                f"{count} rollout ranks do not split into vLLM replicas of "
                f"rollout.tensor_parallel_size={self.tensor_parallel_size}; choose a multiple"
            )
        return count


@dataclass(frozen=True, kw_only=True)
class DataSettings:
    """Prompt datasets."""

    train_path: str
    """Parquet or JSONL in the DAPO-Math-17k schema or plain {prompt, answer}."""
    eval_path: str | None = None
    """Held-out prompts for avg@k / pass@k (e.g. AIME 2024)."""
    template: Literal["dapo", "chat", "raw"] = "dapo"
    """How a prompt becomes tokens: DAPO's instruction, the tokenizer's chat template, or raw text."""
    dedup: bool = False
    """Drop repeated (prompt, answer) rows (the published DAPO-Math-17k repeats each ~100x)."""
    max_prompt_tokens: int = 2048
    """Longer prompts are counted, logged skips."""
    max_bad_fraction: float = 0.01
    """Error when more than this fraction of rows is skipped as bad or too long."""
    shuffle: bool = True
    """Shuffle prompts each epoch (deterministic from trainer.seed)."""
    default_data_source: str = "math_dapo"
    """data_source of plain {prompt, answer} rows (picks the grader)."""


@dataclass(frozen=True, kw_only=True)
class RewardSettings:
    """Verifiers."""

    routing: dict[str, str] = field(default_factory=dict)
    """Extra data_source -> grader name mappings on top of the defaults."""
    plugins: list[str] = field(default_factory=list)
    """Python modules imported at start on every rank; they register graders (rewards.registry.register_grader)."""
    timeout_s: float = 10.0
    """A grader running longer scores the response as wrong (counted in grader_timeouts)."""
    overlong_filter: bool = False
    """Mask truncated responses out of the policy loss (DAPO's overlong filtering)."""


@dataclass(frozen=True, kw_only=True)
class EvalSettings:
    """Held-out evaluation with its own sampling (paper: AIME 2024, k=32, T=1.0, top_p=0.7)."""

    every: int = 0
    """Evaluate every this many steps (0: never during training)."""
    at_start: bool = False
    """Evaluate before the first step."""
    at_end: bool = True
    """Evaluate after the last step (when data.eval_path is set)."""
    k: int = 32
    """Samples per prompt: avg@k and pass@k."""
    temperature: float = 1.0
    """Eval sampling temperature."""
    top_p: float = 0.7
    """Eval nucleus sampling."""
    max_new_tokens: int | None = None
    """None: rollout.max_new_tokens."""
    max_prompts: int | None = None
    """Use only the first this-many eval prompts."""


@dataclass(frozen=True, kw_only=True)
class CriticPretrainSettings:
    """Critic pretraining on Monte-Carlo returns of the frozen initial policy (steps: algorithm.value_pretrain_steps)."""

    min_steps: int = 1
    """Never stop earlier."""
    ev_threshold: float = 0.5
    """Stop early once explained variance is at least this and has plateaued."""
    patience: int = 5
    """Steps without min_delta improvement that count as a plateau."""
    min_delta: float = 0.01
    """Improvement of explained variance that resets the plateau count."""
    offline_rollouts: str | None = None
    """Fit from rollouts saved by an earlier run (its RUN_DIR/rollouts directory) instead of sampling; step k fits the k-th file."""
    save_rollouts: bool = False
    """Save each pretraining step's rollouts under run_dir/rollouts/ (for offline fits)."""


@dataclass(frozen=True, kw_only=True)
class TrainerSettings:
    """The loop: steps, batches, checkpoints, logging."""

    steps: int = 100
    """VAPO steps (after critic pretraining)."""
    mini_batch_size: int = 512
    """Samples per gradient step; the step's samples make several (paper: 8192 in 512s)."""
    ppo_epochs: int = 1
    """Passes over the step's samples."""
    micro_batch_tokens: int = 16384
    """Token budget of one packed micro-batch per rank (a longer sample gets one of its own)."""
    whiten_advantages: bool = False
    """Normalise advantages to zero mean, unit std over the step's response tokens."""
    max_sampling_rounds: int = 4
    """Dynamic sampling: at most this many rollout rounds to fill the batch."""
    seed: int = 1
    """Seeds data order, sampling, initialisation."""
    run_dir: str = "runs/default"
    """Metrics, checkpoints, the resolved config and the exported policy go here."""
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from run_dir/checkpoints/latest when it exists; never: refuse a used run_dir."""
    checkpoint_every: int = 0
    """Save every this many steps (0: only at the end and on SIGTERM/SIGUSR1)."""
    keep_last: int = 2
    """Checkpoints kept."""
    checkpoint_async: bool = False
    """Write checkpoints in the background: the step waits for the host copies only; published once every rank's writer is done (checked before each step; the next save, preemption, the end and rollout.offload_training_state wait for it)."""
    checkpoint_fully_reshardable: bool = False
    """Save a distributed optimizer's state fully reshardable (a resume may change TP/PP; the save gathers each DP group's state in host memory) instead of dp_reshardable (a resume may change DP/CP only)."""
    export_hf: bool = True
    """Write the trained policy as an HF directory (run_dir/hf_policy) at the end."""
    local_world_size: int = 1
    """Ranks to start on this machine when launched plainly (torchrun/srun decide otherwise)."""
    tensorboard: bool = True
    """Write tensorboard events to run_dir/tensorboard."""
    wandb_project: str | None = None
    """Log to this wandb project too (needs the wandb extra)."""
    progress_bar: bool = True
    """A progress bar on rank 0's console."""
    dist_timeout_minutes: float = 60.0
    """How long a rank waits in one collective before the job fails (NCCL and the host
    group). Fast replicas wait in the trajectory gather for the slowest's generation tail
    (32B recipe: 20k tokens at ~30 ms a decode step is ~10 min) and every rank waits while
    checkpoints are written; torch's NCCL default of 10 min would kill healthy runs."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One experiment."""

    model: ModelSettings
    """The initial policy."""
    data: DataSettings
    """Prompts."""
    algorithm: AlgoConfig = field(default_factory=AlgoConfig)
    """What the step computes (a preset plus overrides in YAML: algorithm.preset)."""
    policy: PolicySettings = field(default_factory=PolicySettings)
    """Policy layout and optimizer."""
    critic: CriticSettings = field(default_factory=CriticSettings)
    """Critic layout, optimizer and initialisation."""
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    """Generation."""
    reward: RewardSettings = field(default_factory=RewardSettings)
    """Grading."""
    eval: EvalSettings = field(default_factory=EvalSettings)
    """Held-out evaluation."""
    critic_pretrain: CriticPretrainSettings = field(default_factory=CriticPretrainSettings)
    """Critic pretraining's stop rule and rollouts."""
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    """The loop."""
    gpu: GpuSettings = field(default_factory=GpuSettings)
    """Kernel fusions and DDP overlap of both models (auto: on with CUDA and the kernel; off on CPU)."""

    @property
    def samples_per_step(self) -> int:
        return self.algorithm.prompts_per_step * self.algorithm.samples_per_prompt

    def check(self, world_size: int) -> None:
        """ValueError naming the values and the fix for combinations that cannot run."""
        checks.check_layouts_fit(self, world_size)
        checks.check_batches(self)
        checks.check_lengths(self)
        checks.check_eval(self)
        checks.check_tiny_task(self)
        checks.check_sampling(self)
        checks.check_critic_init(self)
        checks.check_critic_model_setting(self)
        checks.check_loop(self)
