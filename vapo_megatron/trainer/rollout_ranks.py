"""The rollout ranks of the separate placement: vLLM engine replicas that only generate,
grade and evaluate, serving the trainer ranks' orders (``step/remote_rollouts.py`` has the
protocol; ``parallel/placement.py`` the worlds and the bridge).

They hold the prompts and the sampler (the trainers mirror its position from each batch, and
checkpoint it), the tokenizer and graders, and one engine replica per
rollout.tensor_parallel_size of them; no training state, so the device memory beside the
weights is KV cache. The engine never sleeps here: no training shares the device.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

from vapo_megatron.config.train import TrainConfig
from vapo_megatron.data.sampler import PromptSampler
from vapo_megatron.parallel.collectives import barrier, make_host_group
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.parallel.placement import Bridge, Placement, make_bridge
from vapo_megatron.rewards.registry import resolve_routing
from vapo_megatron.step import remote_rollouts as wire
from vapo_megatron.step.context import StepContext
from vapo_megatron.step.rollout import collect_rollouts
from vapo_megatron.step.rollout_queue import QueuedBatch
from vapo_megatron.step.trajectory_wire import gather_routes, send_batch
from vapo_megatron.trainer.evaluation import evaluate
from vapo_megatron.trainer.preemption import PreemptionFlag
from vapo_megatron.trainer.session import (
    dist_timeout,
    import_plugins,
    init_distributed,
    read_prompts,
    start_rollout,
    stop_token_ids,
)
from vapo_megatron.weights.bridge_stream import recv_buckets

logger = logging.getLogger("vapo_megatron")


def serve_rollouts(config: TrainConfig, placement: Placement) -> dict:
    """A rollout rank's whole run: its side's process groups (first: on GPU this takes the
    rank's device, which the bridge's NCCL group then uses), the bridge (joined once the
    trainers have made the run's files, which the engine reads next), its engine replica,
    then orders until STOP. SIGTERM/SIGUSR1 are only noted: the trainers save (with the
    batches made here) and then stop these ranks."""
    init_distributed(dist_timeout(config))
    host = make_host_group(dist_timeout(config))
    bridge = make_bridge(placement, dist_timeout(config))
    ctx, eval_prompts = rollout_context(config, host)
    server = RolloutServer(ctx, bridge, eval_prompts)
    flag = PreemptionFlag()
    try:
        server.run()
    finally:
        flag.uninstall()
        barrier(host)
        ctx.rollout.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"rollout_rank": placement.side_rank, "batches": server.made_upto}


def rollout_context(config: TrainConfig, host_group: dist.ProcessGroup) -> tuple[StepContext, list]:
    """What the rollout ranks' generation and evaluation use: the data, the sampler and the
    engine (random weights until the trainers' first WEIGHTS order); the eval prompts."""
    from transformers import AutoTokenizer

    import_plugins(config.reward.plugins)
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    routing = resolve_routing(config.reward.routing)
    train = read_prompts(config, config.data.train_path, tokenizer, routing)
    rank, tp = dist.get_rank(), config.rollout.tensor_parallel_size
    ctx = StepContext(
        config=config, rollout=start_rollout(config, rank, load_format="dummy"),
        tokenizer=tokenizer, stop_token_ids=stop_token_ids(tokenizer, config.model.path),
        routing=routing, host_group=host_group, rank=rank, replica=rank // tp,
        num_replicas=dist.get_world_size() // tp,
        sampler=PromptSampler(len(train.items), seed=config.trainer.seed, shuffle=config.data.shuffle),
        train_prompts=train.items, run_dir=Path(config.trainer.run_dir), engine_sleeps=False,
    )  # fmt: skip
    eval_prompts = (
        read_prompts(config, config.data.eval_path, tokenizer, routing).items
        if config.data.eval_path
        else []
    )
    return ctx, eval_prompts


class RolloutServer:
    """Serves the orders: the batches of the fixed schedule (``step/rollout_queue.py``), made
    as early as the weights allow, sent when the trainers ask."""

    def __init__(self, ctx: StepContext, bridge: Bridge, eval_prompts: list) -> None:
        self.ctx, self.bridge, self.eval_prompts = ctx, bridge, eval_prompts
        cfg = ctx.config
        self.lag, self.last_step = cfg.rollout.steps_behind, cfg.trainer.steps
        self.made: deque[tuple[QueuedBatch, dict]] = deque()
        """Batches made and not yet sent, with the sampler's position after each."""
        self.made_upto = 0
        """The last VAPO step whose batch is made (sent or not)."""
        self.version = 0
        """The policy version the engine holds."""
        self.waited = 0.0
        """Seconds spent waiting for orders since the last batch sent."""
        self.is_sender = dist.get_rank(ctx.host_group) == 0

    def run(self) -> None:
        handlers = {
            wire.START: self.start, wire.WEIGHTS: self.load_weights, wire.STEP: self.step,
            wire.PRETRAIN: self.pretrain, wire.FLUSH: self.flush, wire.EVAL: self.evaluate,
        }  # fmt: skip
        while True:
            started = time.perf_counter()
            op, a, b, text = wire.recv_order(self.bridge)
            self.waited += time.perf_counter() - started
            if op == wire.STOP:
                return
            if op not in handlers:
                raise RuntimeError(f"unknown order {op} from the trainer ranks")
            handlers[op](a, b, text)

    def start(self, step: int, queued: int, text: bytes) -> None:
        """The run is past ``step`` steps and the trainers hold the next ``queued`` batches."""
        self.ctx.sampler.load_state_dict(json.loads(text))
        self.made_upto = step + queued
        self.made.clear()

    def load_weights(self, version: int, _b: int, _text: bytes) -> None:
        buckets = recv_buckets(self.bridge.weights, self.bridge.weights_device)
        self.ctx.rollout.update_weights(buckets, prefetch=False)
        self.version = version
        self.ctx.weights_current = True

    def step(self, step: int, queued: int, _text: bytes) -> None:
        """Send step ``step``'s batch (unless a flush sent it), then make every batch these
        weights may make: up to ``step + lag`` (the overlap with the trainers' step)."""
        if not queued:
            if not self.made:
                self.make(step)
            batch, sampler = self.made.popleft()
            if batch.step != step:
                raise RuntimeError(f"step {step} asked for, step {batch.step}'s batch is next")
            self.send(batch, sampler)
        for target in range(self.made_upto + 1, min(step + self.lag, self.last_step) + 1):
            self.make(target)

    def make(self, target: int) -> None:
        """Batch ``target`` with the weights held, which must be the schedule's."""
        expected = max(0, target - 1 - self.lag)
        if self.version != expected or target != self.made_upto + 1:
            raise RuntimeError(
                f"batch {target} needs policy version {expected} after batch {self.made_upto}; "
                f"the engine holds version {self.version}: the orders broke the schedule"
            )
        dynamic = self.ctx.config.algorithm.dynamic_sampling
        self.made.append((self.collect(target, target, dynamic=dynamic), self.sampler()))
        self.made_upto = target

    def pretrain(self, seed_step: int, index: int, _text: bytes) -> None:
        self.send(self.collect(index, seed_step, dynamic=False), self.sampler())

    def collect(self, step: int, seed_step: int, *, dynamic: bool) -> QueuedBatch:
        """Batch ``step`` (sampled with ``seed_step``'s seeds) by the weights held, its
        versions set and its MoE routes whole on every rollout rank."""
        trajectories, stats = collect_rollouts(self.ctx, seed_step, dynamic=dynamic)
        trajectories.version = torch.full((len(trajectories),), self.version, device=HOST)
        gather_routes(trajectories, self.ctx.host_group)
        return QueuedBatch(step, self.version, trajectories, stats)

    def flush(self, _a: int, _b: int, _text: bytes) -> None:
        if self.is_sender:
            wire.send_text(self.bridge, str(len(self.made)).encode())
        while self.made:
            self.send(*self.made.popleft())

    def evaluate(self, step: int, _b: int, _text: bytes) -> None:
        metrics = evaluate(self.ctx, step, self.eval_prompts)
        if self.is_sender:
            wire.send_text(self.bridge, json.dumps(metrics).encode())

    def send(self, batch: QueuedBatch, sampler: dict) -> None:
        if self.is_sender:
            info = {"sampler": sampler, "rollout_wait_s": self.waited}
            send_batch(batch, info, self.bridge.samples)
        self.waited = 0.0

    def sampler(self) -> dict:
        return self.ctx.sampler.state_dict()
