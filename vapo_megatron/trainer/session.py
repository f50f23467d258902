"""Everything a run holds: process groups, tokenizer, prompts, the two models, the rollout engine.

``Session.open(config)`` runs on every rank, in the same order (the groups and the models are
collective to build). The policy and the critic get their own process groups over the whole
world, so each takes its own layout; the rollout engine (one vLLM replica per
rollout.tensor_parallel_size consecutive ranks) is started last, once the process group exists.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from vapo_megatron.checkpoint import model as mckpt
from vapo_megatron.config.checks import (
    check_critic_start,
    check_layouts_on_models,
    critic_has_own_model,
)
from vapo_megatron.config.gpu import GpuSettings
from vapo_megatron.config.train import TrainConfig
from vapo_megatron.data.prompts import TokenizedPrompt, load_prompts, tokenize_prompts
from vapo_megatron.data.sampler import PromptSampler
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.collectives import make_host_group
from vapo_megatron.parallel.model_groups import (
    ModelGroups,
    build_model_groups,
    ensure_global_memory_buffer,
    seed_rng_tracker,
)
from vapo_megatron.parallel.placement import Bridge
from vapo_megatron.rewards.registry import check_data_sources, resolve_routing
from vapo_megatron.run_log import native_stderr_to_rank_log
from vapo_megatron.step.context import StepContext
from vapo_megatron.step.remote_rollouts import RemoteRollouts
from vapo_megatron.step.rollout_queue import RolloutQueue
from vapo_megatron.weights import hf_io
from vapo_megatron.weights.critic import (
    check_critic_model,
    check_reward_model_fits,
    critic_from_policy,
    critic_hf_config,
    critic_model_path,
    policy_hf_tensors,
    reward_model_hf_tensors,
)
from vapo_megatron.weights.mtp import check_policy_checkpoint

logger = logging.getLogger("vapo_megatron")


def init_distributed(timeout: timedelta | None = None) -> None:
    """The default process group (gloo on CPU, NCCL on GPU) and, on CPU, the Megatron shim.

    ``timeout`` bounds every collective of the default group (``trainer.dist_timeout_minutes``;
    torch's NCCL default is 10 minutes). On GPU each rank takes device LOCAL_RANK first, so
    NCCL and every later allocation land on its own GPU."""
    if not dist.is_initialized():
        kwargs = {} if timeout is None else {"timeout": timeout}
        if "RANK" not in os.environ:  # one plain process
            dist.init_process_group(
                "gloo", store=dist.HashStore(), rank=0, world_size=1, **kwargs
            )  # fmt: skip
        else:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, **kwargs)
    if not torch.cuda.is_available():
        from vapo_megatron.parallel.cpu_shim import apply_cpu_shim

        apply_cpu_shim()


def dist_timeout(config: TrainConfig) -> timedelta:
    """The recipe's collective timeout."""
    return timedelta(minutes=config.trainer.dist_timeout_minutes)


@dataclass
class Prompts:
    """A tokenized prompt set and how it was read."""

    items: list[TokenizedPrompt]
    report: str


def read_prompts(config: TrainConfig, path: str, tokenizer, routing) -> Prompts:
    data = config.data
    records, load_report = load_prompts(
        path, default_data_source=data.default_data_source, dedup=data.dedup,
        max_bad_fraction=data.max_bad_fraction,
    )  # fmt: skip
    check_data_sources({r.data_source for r in records}, routing)
    items, tok_report = tokenize_prompts(
        records, tokenizer, data.template, data.max_prompt_tokens,
        max_bad_fraction=data.max_bad_fraction,
    )  # fmt: skip
    if not items:
        raise ValueError(f"{path}: no usable prompts ({load_report}, {tok_report})")
    report = (
        f"{path}: {load_report.num_rows} rows, {load_report.num_duplicates} duplicates removed, "
        f"{load_report.num_skipped} bad rows skipped {load_report.skipped or ''}, "
        f"{tok_report.num_too_long} over {data.max_prompt_tokens} tokens, {len(items)} prompts"
    )
    return Prompts(items, report)


def build_groups(
    config: TrainConfig, host_group: dist.ProcessGroup
) -> tuple[ModelGroups, ModelGroups | None]:
    """The policy's and (with a critic) the critic's process groups, each over the whole world
    in its own layout, every one bounded by ``trainer.dist_timeout_minutes``, then megatron's
    process-global scratch buffer and RNG tracker. Collective: every rank calls it at the
    same point (``planning/dry_run.py`` too)."""
    policy, critic = config.policy.layout, config.critic.layout
    policy = build_model_groups(
        tp=policy.tp, pp=policy.pp, cp=policy.cp, ep=policy.ep, etp=policy.etp,
        host=host_group, timeout=dist_timeout(config),
    )  # fmt: skip
    if config.algorithm.uses_critic:
        critic = build_model_groups(
            tp=critic.tp, pp=critic.pp, cp=critic.cp, ep=critic.ep, etp=critic.etp,
            host=host_group, timeout=dist_timeout(config),
        )  # fmt: skip
    else:
        critic = None
    ensure_global_memory_buffer()
    seed_rng_tracker(policy, seed=config.trainer.seed)
    return policy, critic


def build_engine(
    config: TrainConfig,
    hf: HFModelConfig,
    role: Literal["policy", "critic"],
    groups: ModelGroups,
    *,
    gpu: GpuSettings | None = None,
) -> ModelEngine:
    """The recipe's policy (LM head) or critic (value head) on ``groups``, weights neither
    loaded nor initialised: every caller loads every parameter next (``Session``: the policy
    from policy.load or model.path, the critic from a checkpoint, a reward model or the
    policy's trunk with a seeded value head; the dry run builds on meta and reads no value).
    ``gpu``: None takes the recipe's (the dry run passes its own, kernels off)."""
    settings = config.policy if role == "policy" else config.critic
    return ModelEngine(
        hf, settings.layout, head="lm" if role == "policy" else "value", optim=settings.optim,
        groups=groups, params_dtype=getattr(torch, config.model.dtype),
        gpu=config.gpu if gpu is None else gpu, recompute=settings.recompute, initialize=False,
        moe=settings.moe,
        mtp_loss_weight=config.policy.mtp.loss_weight if role == "policy" else 0.0,
    )  # fmt: skip


class Session:
    """One rank's share of a run."""

    def __init__(
        self,
        config: TrainConfig,
        run_dir: Path,
        host_group: dist.ProcessGroup | None = None,
        *,
        bridge: Bridge | None = None,
        job_world: int | None = None,
    ) -> None:
        """``bridge``: the separate placement's trainer ranks (no engine here: the rollout
        ranks generate), with ``job_world`` ranks in the whole job."""
        self.config = config
        self.run_dir = run_dir
        init_distributed(dist_timeout(config))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.host_group = (
            make_host_group(dist_timeout(config)) if host_group is None else host_group
        )
        """Gloo over every rank: counts, timings, objects, barriers (``parallel/collectives``)."""
        config.check(job_world or self.world_size)
        # Under torchrun/srun no launcher process checked these first (``train.check_before_ranks``).
        check_layouts_on_models(config, hf_io.written_model_configs(config), self.world_size)
        check_critic_start(
            config, has_pretrained_critic=_is_model_dir(self.pretrained_critic_dir())
        )
        check_critic_model(config)  # critic.model: the policy's tokenizer, enough context
        torch.manual_seed(config.trainer.seed)
        self._read_data()
        self._build_models()
        lag = config.rollout.steps_behind
        self.remote = self.rollout = None
        queue = RolloutQueue(lag) if lag else None
        if bridge is not None:  # the rollout ranks generate
            self.remote = RemoteRollouts(
                bridge, lag, is_sender=self.rank == 0, sampler=self.sampler,
            )  # fmt: skip
            queue = self.remote.queue
        else:
            self.rollout = self._start_rollout()
        self.context = StepContext(
            config=config, rollout=self.rollout, tokenizer=self.tokenizer,
            stop_token_ids=self.stop_token_ids, routing=self.routing, host_group=self.host_group,
            rank=self.rank, replica=self.replica, num_replicas=self.num_replicas,
            policy=self.policy, critic=self.critic, sampler=self.sampler,
            train_prompts=self.train.items, run_dir=run_dir, remote=self.remote,
            rollout_queue=queue,
        )  # fmt: skip
        """What the step and evaluation use of the run (and the engine's staleness)."""

    def _read_data(self) -> None:
        """The tokenizer and stop tokens, the graders, the prompt sets and the train sampler."""
        from transformers import AutoTokenizer

        config = self.config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        self.stop_token_ids = stop_token_ids(self.tokenizer, config.model.path)
        import_plugins(config.reward.plugins)
        self.routing = resolve_routing(config.reward.routing)
        self.train = read_prompts(config, config.data.train_path, self.tokenizer, self.routing)
        self.eval = (
            read_prompts(config, config.data.eval_path, self.tokenizer, self.routing)
            if config.data.eval_path
            else None
        )
        self.sampler = PromptSampler(
            len(self.train.items), seed=config.trainer.seed, shuffle=config.data.shuffle
        )

    def _build_models(self) -> None:
        """Both models' process groups and engines, with their weights (collective)."""
        config = self.config
        self.hf = HFModelConfig.from_hf(hf_io.read_config(config.model.path))
        self.policy_groups, self.critic_groups = build_groups(config, self.host_group)
        self.policy = build_engine(config, self.hf, "policy", self.policy_groups)
        if config.algorithm.routing_replay == "rollout":  # R3: the engine's routes (MoE)
            if not self.hf.is_moe:
                raise ValueError(
                    f"algorithm.routing_replay=rollout needs an MoE policy; {config.model.path} "
                    "is dense: set algorithm.routing_replay=none"
                )
            self.policy.track_routes(replay=True)
        policy_tensors = self._load_policy()
        self.critic = self.critic_hf_config = self.critic_hf = None
        if config.algorithm.uses_critic:
            # The critic's own model (critic.model), by default the policy's.
            self.critic_hf_config = critic_hf_config(config)
            self.critic_hf = HFModelConfig.from_hf(self.critic_hf_config)
            self.critic = build_engine(config, self.critic_hf, "critic", self.critic_groups)
            if self.critic_hf.is_moe and config.critic.routing_replay == "scoring":
                self.critic.track_routes(replay=True)  # its scoring pass's routes, replayed
            self._init_critic(policy_tensors)

    def _load_policy(self) -> dict[str, torch.Tensor] | None:
        """Policy weights from policy.load (a Megatron checkpoint), else from model.path;
        returns the HF tensors it read (the critic may start from them), None from a
        checkpoint."""
        config = self.config
        if config.policy.load:
            check_policy_checkpoint(
                mckpt.load_metadata(config.policy.load), trained=config.policy.mtp.trained,
                path=config.policy.load,
            )  # fmt: skip
            mckpt.load_model_weights(
                self.policy.chunks, config.policy.load, hf=self.hf, head="lm",
                dp_cp_group=self.policy.groups.pg_collection.dp_cp, host_group=self.host_group,
            )  # fmt: skip
            self.policy.optimizer.reload_model_params()
            return None
        policy_tensors = policy_hf_tensors(config.model.path)
        self.policy.load_hf(policy_tensors)
        return policy_tensors

    def _init_critic(self, policy_tensors: dict[str, torch.Tensor] | None) -> None:
        """Critic weights: a pretrained critic (this run's or critic.pretrained), else a reward
        model (critic.init_path, else critic.model when it is not the policy's), else the
        policy's trunk with a new value head."""
        config = self.config
        for path in (config.critic.pretrained, self.pretrained_critic_dir()):
            if path and _is_model_dir(Path(path)):
                self.load_critic(path)
                self.critic_source = f"pretrained critic {path}"
                self.critic_pretrained = True
                return
        if config.critic.pretrained:
            raise ValueError(
                f"critic.pretrained={config.critic.pretrained} is neither an HF directory nor a "
                "Megatron checkpoint; point it at a run's critic_pretrained directory"
            )
        self.critic_pretrained = False
        # A reward model, or the policy converted as a critic; else critic.model's own weights.
        own_model = config.critic.model if critic_has_own_model(config) else None
        init_path = config.critic.init_path or own_model
        if init_path:
            self.load_critic(init_path)
            self.critic_source = f"{init_path} ({config.algorithm.critic_init})"
            return
        if policy_tensors is None:
            policy_tensors = policy_hf_tensors(config.model.path)
        self.critic.load_hf(
            critic_from_policy(
                policy_tensors, self.hf, config.critic.value_head_init_std, config.trainer.seed
            )
        )
        self.critic_source = "policy weights + new value head"

    def pretrained_critic_dir(self) -> Path:
        return self.run_dir / "critic_pretrained"

    def load_critic(self, path: str | Path) -> None:
        """A critic Megatron checkpoint (any layout) or an HF directory with score.weight, of
        the critic's model."""
        path = Path(path)
        if (path / mckpt.METADATA_NAME).is_file():
            mckpt.load_model_weights(
                self.critic.chunks, path, hf=self.critic_hf, head="value",
                dp_cp_group=self.critic.groups.pg_collection.dp_cp, host_group=self.host_group,
            )  # fmt: skip
            self.critic.optimizer.reload_model_params()
            return
        check_reward_model_fits(path, self.critic_hf, critic_model_path(self.config))
        self.critic.load_hf(reward_model_hf_tensors(path))

    def _start_rollout(self):
        """The engine, started from random weights (the first sync overwrites every one). With
        rollout.offload_training_state the training state is off the device while vLLM starts
        (it sizes its memory from what is free then) and whenever the engine is awake; the
        engine goes to sleep at once, which brings the training state back."""
        offload = None
        if self.config.rollout.offload_training_state:
            from vapo_megatron.engine.offload import TrainingOffload

            offload = TrainingOffload(self.policy, self.critic)
            offload.offload_all()
        # vLLM's CPU worker notes its NUMA memory binding from C++, straight to stderr.
        cpu = not torch.cuda.is_available()
        with native_stderr_to_rank_log() if cpu else contextlib.nullcontext():
            engine = start_rollout(
                self.config, self.rank, training_offload=offload, load_format="dummy"
            )
        if offload is not None:
            engine.sleep()
        return engine

    @property
    def num_replicas(self) -> int:
        """vLLM engine replicas in the job (world / rollout TP)."""
        return self.world_size // self.config.rollout.tensor_parallel_size

    @property
    def replica(self) -> int:
        """This rank's engine replica (ranks r*k .. r*k + k-1 form replica r, k = rollout TP)."""
        return self.rank // self.config.rollout.tensor_parallel_size

    @property
    def is_replica_leader(self) -> bool:
        """First rank of its replica: the one that hands the replica's samples to the gather."""
        return self.rank % self.config.rollout.tensor_parallel_size == 0

    def close(self) -> None:
        # vLLM tears down the default process group with the engine (every rank of every
        # replica together): shut it down last.
        if self.remote is not None:
            self.remote.stop()
        collectives.barrier(self.host_group)
        if self.rollout is not None:
            self.rollout.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


def _is_model_dir(path: Path) -> bool:
    return (path / mckpt.METADATA_NAME).is_file() or (path / "config.json").is_file()


def import_plugins(modules) -> None:
    """reward.plugins: import each module (it registers its graders)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ValueError(
                f"reward.plugins: cannot import {module!r} ({err}); put it on PYTHONPATH "
                "or remove it from the recipe"
            ) from err


def start_rollout(
    config: TrainConfig, rank: int, *, training_offload=None, load_format: str = "auto"
):
    """This rank's part of its vLLM engine replica, started from model.path (its weights with
    ``load_format='auto'``, random ones with 'dummy'): each
    rollout.tensor_parallel_size consecutive ranks form one replica (vLLM's external_launcher;
    every rank builds its part at the same time). Replicas are seeded apart, the ranks of one
    replica alike (they sample in lockstep)."""
    from vapo_megatron.rollout.engine import RolloutConfig, RolloutEngine

    r = config.rollout
    replica = rank // r.tensor_parallel_size
    return RolloutEngine(
        RolloutConfig(
            model_path=config.model.path, tensor_parallel_size=r.tensor_parallel_size,
            dtype=r.dtype, max_model_len=r.max_model_len, seed=config.trainer.seed + replica,
            kv_cache_bytes=r.kv_cache_bytes, gpu_memory_utilization=r.gpu_memory_utilization,
            enforce_eager=r.enforce_eager, weight_bucket_bytes=r.weight_bucket_bytes,
            sleep_level=r.sleep_level, load_format=load_format, dist_timeout=dist_timeout(config),
            # After temperature (and top-p): at top_p = 1 these equal the Megatron policy's
            # log-probs at the sampling temperature, which the log-prob gap compares with.
            logprobs_mode="processed_logprobs",
            record_routes=config.algorithm.routing_replay == "rollout",
        ),
        training_offload=training_offload,
    )  # fmt: skip


def stop_token_ids(tokenizer, model_path: str) -> list[int]:
    """EOS ids from the tokenizer and generation_config.json."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation = Path(model_path, "generation_config.json")
    if generation.is_file():
        import json

        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else eos or [])
    if not ids:
        raise ValueError(
            f"{model_path}: the tokenizer has no eos_token and generation_config.json names no "
            "eos_token_id; responses would never stop. Set one of them"
        )
    return sorted(ids)
