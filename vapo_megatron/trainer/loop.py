"""The run: resume, critic pretraining, VAPO steps with evaluation and checkpoints, export.

``train(config)`` is what ``vapo-train`` calls on every rank. Checkpoints hold both models,
both optimizers and schedulers, the data position, the critic-pretraining stop rule, every
rank's RNG and the step; they are written every ``trainer.checkpoint_every`` steps, at the
end, and when SIGTERM/SIGUSR1 arrives (then the run stops, to be resumed by the same command).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch.distributed as dist

from vapo_megatron.algorithms.value_pretrain import ValuePretrainStop
from vapo_megatron.checkpoint.directory import latest_step
from vapo_megatron.checkpoint.load import load_train_checkpoint
from vapo_megatron.checkpoint.model import make_metadata
from vapo_megatron.checkpoint.save import CheckpointSaver
from vapo_megatron.checkpoint.state import TrainableState
from vapo_megatron.config.recipe import config_to_dict, dump_config
from vapo_megatron.config.train import TrainConfig
from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.collectives import make_host_group
from vapo_megatron.parallel.placement import ROLLOUT, Placement, make_bridge, split_world
from vapo_megatron.step.run import run_step
from vapo_megatron.tiny.assets import ensure_tiny_assets
from vapo_megatron.tiny.reward_model import ensure_tiny_critic
from vapo_megatron.trainer.evaluation import evaluate
from vapo_megatron.trainer.metrics import MetricsLogger
from vapo_megatron.trainer.preemption import PreemptionFlag
from vapo_megatron.trainer.rollout_ranks import serve_rollouts
from vapo_megatron.trainer.session import Session, dist_timeout, init_distributed
from vapo_megatron.weights import hf_io
from vapo_megatron.weights.critic import critic_model_path

logger = logging.getLogger("vapo_megatron")
PRETRAIN_SEED_KEY = 10**6  # critic-pretraining steps draw other seeds than VAPO steps


def train(config: TrainConfig) -> dict:
    """Run (or resume) the experiment; return the summary (also written to summary.json).
    In the separate placement the rollout ranks serve the trainers instead
    (``trainer/rollout_ranks.py``)."""
    start = time.perf_counter()
    placement = None
    if config.rollout.placement == "separate":
        placement = split_world(config.rollout.rollout_world(int(os.environ["WORLD_SIZE"])))
        if placement.role == ROLLOUT:
            return serve_rollouts(config, placement)
    run, resumed = open_run(config, placement)
    session = run.session
    metrics_log = _metrics_logger(run)
    flag = PreemptionFlag()
    summary: dict = {"resumed": resumed}
    try:
        if run.stop_rule is not None and not run.state["pretrain_done"]:
            if _pretrain_critic(run, metrics_log, flag):
                return _preempted(run)
            summary["critic_pretrain_steps"] = run.state["pretrain_step"]
        _export_pretrained_critic(run)
        evals = Evaluations(session, metrics_log)
        if config.eval.at_start and run.state["step"] == 0:
            evals.run(0)
        while run.state["step"] < config.trainer.steps:
            if _vapo_step(run, metrics_log, flag):
                return _preempted(run)
            if config.eval.every and run.state["step"] % config.eval.every == 0:
                evals.run(run.state["step"])
        run.save_final()
        if session.eval is not None and config.eval.at_end:
            summary["eval"] = evals.final(run.state["step"])
        if config.trainer.export_hf:
            summary["hf_policy"] = str(_export_policy(run))
        summary.update(
            steps=run.state["step"], critic_pretrain_steps=run.state["pretrain_step"],
            seconds=time.perf_counter() - start, metrics=str(metrics_log.jsonl_path),
        )  # fmt: skip
        _write_summary(run, summary)
        return summary
    except BaseException:
        # Mid-protocol a STOP order could wait forever on a rollout rank busy in another
        # group: the launcher (or torchrun/srun) ends the rollout ranks with the failed job.
        session.remote = None
        raise
    finally:
        flag.uninstall()
        metrics_log.close()
        session.close()


def open_run(config: TrainConfig, placement: Placement | None = None) -> tuple[Run, bool]:
    """Start-up on every rank: the process groups, the tiny models' files (model.create_tiny,
    critic.create_tiny), the run directory and the session; with trainer.resume=auto, the
    latest checkpoint. Returns the run and whether it resumed. With a ``placement`` (the
    separate placement's trainer ranks), the bridge to the rollout ranks once the files
    exist, and the rollout ranks told where the run starts, with the policy's weights."""
    init_distributed(dist_timeout(config))
    host = make_host_group(dist_timeout(config))
    ensure_tiny_assets(config, host)
    ensure_tiny_critic(config, host)
    run_dir = prepare_run_dir(config, host)
    bridge, job_world = None, None
    if placement is not None:
        bridge = make_bridge(placement, dist_timeout(config))
        job_world = placement.trainer_world + placement.rollout_world
    run = Run(Session(config, run_dir, host_group=host, bridge=bridge, job_world=job_world))
    resumed = config.trainer.resume == "auto" and run.resume()
    remote = run.session.remote
    if remote is not None:
        buckets = run.session.policy.hf_buckets(config.rollout.weight_bucket_bytes)
        remote.start(run.state["step"], run.session.sampler.state_dict(), buckets)
    _log_start(run, resumed)
    return run, resumed


def prepare_run_dir(config: TrainConfig, host_group: dist.ProcessGroup) -> Path:
    """Create the run directory (rank 0 writes config.yaml); refuse a used one with resume=never."""
    run_dir = Path(config.trainer.run_dir)
    checkpoints = run_dir / "checkpoints"
    if config.trainer.resume == "never" and latest_step(checkpoints) is not None:
        raise ValueError(
            f"{run_dir} already holds checkpoints and trainer.resume=never; pick another "
            "trainer.run_dir or set trainer.resume=auto to continue it"
        )
    if dist.get_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(config, run_dir / "config.yaml")
    collectives.barrier(host_group)
    return run_dir


def _metrics_logger(run: Run) -> MetricsLogger:
    """The run's metrics (jsonl, and the recipe's TensorBoard, W&B and progress bar): rank 0."""
    trainer = run.cfg.trainer
    return MetricsLogger(
        run.session.run_dir, total_steps=trainer.steps, start_step=run.state["step"],
        tensorboard=trainer.tensorboard, wandb_project=trainer.wandb_project,
        progress_bar=trainer.progress_bar, config=config_to_dict(run.cfg),
        enabled=run.session.rank == 0,
    )  # fmt: skip


def _pretrain_critic(run: Run, metrics_log: MetricsLogger, flag: PreemptionFlag) -> bool:
    """Critic pretraining (frozen policy, Monte-Carlo returns) until the stop rule says so, with
    a checkpoint every ``trainer.checkpoint_every`` steps and at the end; True when a signal
    stopped it (checkpoint saved)."""
    session, host = run.session, run.session.host_group
    every = run.cfg.trainer.checkpoint_every
    while True:
        run.before_step()
        step = run.state["pretrain_step"] + 1
        metrics = run_step(
            session.context, PRETRAIN_SEED_KEY + step, pretrain=True, pretrain_index=step
        )
        run.state["pretrain_step"] = step
        metrics_log.log(step, metrics, phase="critic_pretrain")
        if run.stop_rule.update(step, metrics.get("critic/explained_variance", float("nan"))):
            break
        preempted = flag.should_save(host)
        if preempted or (every and step % every == 0):
            run.save(wait=preempted)
        if preempted:
            return True
    run.state["pretrain_done"] = True
    # Published before the critic's export: a run killed in between resumes from this
    # checkpoint and exports then. Exported first, a restart would find the export without
    # the checkpoint, skip pretraining and start VAPO where pretraining began.
    run.save(wait=True)
    return False


def _export_pretrained_critic(run: Run) -> None:
    """Write ``RUN_DIR/critic_pretrained`` from the critic at the end of its pretraining: now,
    when this run pretrained it and no VAPO step has moved it yet; a later run (or
    ``critic.pretrained``) loads it."""
    session = run.session
    out = session.pretrained_critic_dir()
    if run.stop_rule is None or not run.state["pretrain_step"] or (out / "config.json").is_file():
        return
    if run.state["step"]:
        if session.rank == 0:
            logger.warning(
                "%s is missing and the critic has been trained past its pretraining (step %d): "
                "not exported; its pretrained weights are in checkpoint step %d",
                out, run.state["step"], run.state["pretrain_step"],
            )  # fmt: skip
        return
    session.critic.export_hf(
        out, hf_config=session.critic_hf_config,
        assets_from=critic_model_path(run.cfg), host_group=session.host_group,
    )  # fmt: skip


def _vapo_step(run: Run, metrics_log: MetricsLogger, flag: PreemptionFlag) -> bool:
    """One VAPO step and its metrics, with a checkpoint every ``trainer.checkpoint_every``
    steps (the last step's is written at the end) and on a signal; True when a signal stops
    the run (checkpoint saved)."""
    run.before_step()
    step = run.state["step"] + 1
    metrics = run_step(run.session.context, step, pretrain=False)
    run.state["step"] = step
    metrics_log.log(step, metrics, phase="train")
    preempted = flag.should_save(run.session.host_group)
    every = run.cfg.trainer.checkpoint_every
    if preempted or (every and step % every == 0 and step < run.cfg.trainer.steps):
        started = time.perf_counter()  # with checkpoint_async: the host copies only
        run.save(wait=preempted)
        metrics_log.log(step, {"seconds": time.perf_counter() - started}, phase="checkpoint")
    return preempted


class Evaluations:
    """Held-out evaluation during the run (none without data.eval_path), each logged; the last
    one is kept, so a run that evaluated its last step does not evaluate it again at the end."""

    def __init__(self, session: Session, metrics_log: MetricsLogger) -> None:
        self.session, self.metrics_log = session, metrics_log
        self.last: tuple[int, dict[str, float]] | None = None

    def run(self, step: int) -> dict[str, float] | None:
        if self.session.eval is None:
            return None
        remote = self.session.remote
        if remote is not None:  # on the rollout ranks, with the weights last published
            metrics = remote.evaluate(step)
        else:
            metrics = evaluate(self.session.context, step, self.session.eval.items)
        self.metrics_log.log(step, metrics, phase="eval")
        self.last = (step, metrics)
        return metrics

    def final(self, step: int) -> dict[str, float] | None:
        """The evaluation at ``step``, the run's last: the kept one if it was of that step."""
        if self.last is not None and self.last[0] == step:
            return self.last[1]
        return self.run(step)


def _export_policy(run: Run) -> Path:
    """The trained policy as an HF directory, RUN_DIR/hf_policy (trainer.export_hf)."""
    out = run.session.run_dir / "hf_policy"
    run.session.policy.export_hf(
        out, hf_config=hf_io.read_config(run.cfg.model.path),
        assets_from=run.cfg.model.path, host_group=run.session.host_group,
    )  # fmt: skip
    return out


def _write_summary(run: Run, summary: dict) -> None:
    if run.session.rank == 0:
        (run.session.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        logger.info("done: %s", json.dumps(summary))


def _preempted(run: Run) -> dict:
    if run.session.rank == 0:
        logger.warning(
            "signal received: checkpoint saved at %s; run the same command again to resume",
            run.root,
        )
    return {"preempted": True, **run.state}


def _log_start(run: Run, resumed: bool) -> None:
    session = run.session
    if session.rank != 0:
        return
    cfg = session.config
    logger.info("train prompts: %s", session.train.report)
    if session.eval is not None:
        logger.info("eval prompts: %s", session.eval.report)
    if session.remote is not None:
        logger.info(
            "separate placement: %d trainer ranks (policy %s, critic %s); the rollout ranks "
            "generate %d step(s) ahead", session.world_size, cfg.policy.layout,
            cfg.critic.layout if session.critic is not None else "none", cfg.rollout.steps_behind,
        )  # fmt: skip
        return
    logger.info(
        "world %d: policy %s, critic %s, %d vLLM replica(s) of TP %d",
        session.world_size, cfg.policy.layout,
        cfg.critic.layout if session.critic is not None else "none",
        session.num_replicas, cfg.rollout.tensor_parallel_size,
    )  # fmt: skip
    if session.critic is not None:
        logger.info("critic from %s", session.critic_source)
    if resumed:
        logger.info("resumed from %s at step %s", run.root, run.state)


class Run:
    """One rank's view of the whole run."""

    def __init__(self, session: Session) -> None:
        self.session = session
        cfg = session.config
        self.cfg = cfg
        self.root = session.run_dir / "checkpoints"
        self.state = {"step": 0, "pretrain_step": 0, "pretrain_done": False}
        algo = cfg.algorithm
        self.stop_rule = None
        if algo.uses_critic and algo.value_pretrain_steps:
            cp = cfg.critic_pretrain
            self.stop_rule = ValuePretrainStop(
                max_steps=algo.value_pretrain_steps, min_steps=min(cp.min_steps, algo.value_pretrain_steps),
                ev_threshold=cp.ev_threshold, patience=cp.patience, min_delta=cp.min_delta,
            )  # fmt: skip
        if session.critic is not None and session.critic_pretrained:
            self.state["pretrain_done"] = True
        self.saver = CheckpointSaver(asynchronous=cfg.trainer.checkpoint_async)

    def models(self) -> dict[str, TrainableState]:
        # As export_hf writes each model: the critic's own config (critic.model).
        configs = {
            "policy": hf_io.read_config(self.cfg.model.path),
            "critic": self.session.critic_hf_config,
        }
        out = {}
        for name, engine in (("policy", self.session.policy), ("critic", self.session.critic)):
            if engine is None:
                continue
            # With weights metadata, each step's <model>/weights exports to HF as it is.
            meta = make_metadata(
                configs[name], head=engine.head, tp=engine.layout.tp, pp=engine.layout.pp,
                dtype=engine.config.params_dtype, origin={"run_dir": str(self.session.run_dir)},
            )  # fmt: skip
            out[name] = engine.trainable_state(
                weights_meta=meta, fully_reshardable=self.cfg.trainer.checkpoint_fully_reshardable
            )
        return out

    def before_step(self) -> None:
        """Publish a checkpoint written in the background once every rank is done with it;
        wait for it when the step starts by offloading the training state."""
        if self.cfg.rollout.offload_training_state:
            self.saver.finish()
        else:
            self.saver.poll()

    def save(self, *, wait: bool = False) -> None:
        """Checkpoint the run (in the background with trainer.checkpoint_async, unless
        ``wait``: preemption and the end of the run wait until it is published)."""
        for engine in (self.session.policy, self.session.critic):
            if engine is not None:  # whole parameters, with overlap_param_gather
                engine.gather_params()
        if self.session.remote is not None:  # the batches made ahead are saved, not lost
            self.session.remote.flush()
        queue = self.session.context.rollout_queue
        extra = {
            "state": dict(self.state),
            "sampler": self.session.sampler.state_dict(),
            "stop_rule": None if self.stop_rule is None else self.stop_rule.state_dict(),
            "rollout_queue": None if queue is None else queue.state_dict(),
        }
        self.saver.save(
            self.root, self._checkpoint_index(), self.models(), extra,
            keep_last=self.cfg.trainer.keep_last, group=self.session.host_group,
            rank_extra=None if queue is None else {"rollout_queue": queue.rank_state()},
        )  # fmt: skip
        if wait:
            self.saver.finish()

    def save_final(self) -> None:
        """At the end of the run: publish a checkpoint in flight, then write the last step's
        unless it is already the newest (it was due at the last step)."""
        self.saver.finish()
        if latest_step(self.root) != self._checkpoint_index():
            self.save(wait=True)

    def _resume_rollout_queue(self, extra: dict) -> None:
        """The in-flight batches of ``rollout.lag`` from the checkpoint (``extra``), with this
        rank's part of their routes; a lag the checkpoint's queue does not match is refused."""
        queue = self.session.context.rollout_queue
        saved = extra.get("rollout_queue") or []
        if queue is None:
            if saved:
                raise ValueError(
                    f"the checkpoint holds {len(saved)} in-flight rollout batches of a run with "
                    "rollout.lag > 0, and this run has rollout.lag=0: resume with the saved lag"
                )
            return
        expected = min(queue.lag, self.cfg.trainer.steps - self.state["step"])
        if self.state["step"] and len(saved) != expected:
            raise ValueError(
                f"the checkpoint holds {len(saved)} in-flight rollout batches at step "
                f"{self.state['step']}, rollout.lag={queue.lag} needs {expected}: resume with the "
                "lag (and trainer.steps) that saved it"
            )
        rank_extra = extra.get("rank_extra") or {}
        queue.load_state_dict(saved, rank_extra.get("rollout_queue"))

    def _checkpoint_index(self) -> int:
        # Pretraining steps and VAPO steps share one increasing checkpoint numbering.
        return self.state["pretrain_step"] + self.state["step"]

    def resume(self) -> bool:
        extra = load_train_checkpoint(self.root, self.models(), group=self.session.host_group)
        if extra is None:
            return False
        self.state.update(extra["state"])
        self.session.sampler.load_state_dict(extra["sampler"])
        if self.stop_rule is not None and extra["stop_rule"] is not None:
            self.stop_rule.load_state_dict(extra["stop_rule"])
        self._resume_rollout_queue(extra)
        self.session.context.weights_current = False
        return True
