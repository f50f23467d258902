"""Worker: kill -9 during an asynchronous checkpoint save leaves the previous checkpoint as
``latest``, and the run resumes from it.

``kill`` (2 ranks, each in its own process group, as a job step's processes): train 2 steps,
save step 2 in the background and finish it; train 2 more, start saving step 4 in the
background with a writer that stops for a minute after its first file set (so the kill lands
mid-write), wait until that file set is on disk, then SIGKILL the whole process group: rank,
writer and megatron's result-queue manager. ``resume`` (2 ranks): ``latest`` is step 2, the
step-4 save is a ``.tmp-*`` directory with files in it, step 2 loads, and the next save removes
the leftover.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tests.distributed.checkpoint.workers.train_checkpoint_worker import Run
from tests.distributed.step.workers.train_step_worker import make_samples, make_weights
from vapo_megatron.checkpoint import save as checkpoint_save
from vapo_megatron.checkpoint.directory import complete_steps, latest_step
from vapo_megatron.checkpoint.load import load_train_checkpoint
from vapo_megatron.checkpoint.save import CheckpointSaver
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu


def slow_writer(calls) -> None:
    """The background job's writes, stopping after the first (the policy's weights)."""
    first, *_ = calls
    fn, args, kwargs = first
    fn(*args, **kwargs)
    time.sleep(60)


def kill_phase(root: Path, run: Run) -> None:
    os.setsid()  # the rank, its forked writer and the queue manager: one process group
    saver = CheckpointSaver(asynchronous=True)
    for _ in (1, 2):
        run.train_step()
    saver.save(root, 2, run.states, {"step": 2}, keep_last=2)
    assert saver.finish() == 2 and latest_step(root) == 2
    for _ in (3, 4):
        run.train_step()
    checkpoint_save._run_calls = slow_writer  # the fork below inherits it
    saver.save(root, 4, run.states, {"step": 4}, keep_last=2)
    written = None
    for _ in range(600):  # the writer's first file set on disk
        written = sorted(root.glob("step_00000004.tmp-*/policy/weights/*.distcp"))
        if written:
            break
        time.sleep(0.1)
    assert written, "the background writer wrote nothing within a minute"
    print(f"rank {dist.get_rank()}: killing during the async save of step 4", flush=True)
    os.killpg(os.getpgid(0), signal.SIGKILL)


def resume_phase(root: Path, run: Run) -> None:
    assert latest_step(root) == 2 and complete_steps(root) == [2], complete_steps(root)
    leftovers = sorted(p.name for p in root.glob("step_00000004.tmp-*"))
    assert len(leftovers) == 1, leftovers
    assert load_train_checkpoint(root, run.states) == {"step": 2}
    CheckpointSaver().save(root, 3, run.states, {"step": 3}, keep_last=2)
    names = sorted(p.name for p in root.iterdir())
    assert names == ["latest", "step_00000002", "step_00000003"], names
    print(f"rank {dist.get_rank()}: resumed from step 2; leftover {leftovers[0]} removed")


def main() -> None:
    phase, root = sys.argv[1], Path(sys.argv[2])
    policy_sd, critic_sd = make_weights()
    samples = make_samples(policy_sd)
    initialize_megatron_cpu()
    hf_sds = {"policy": policy_sd, "critic": critic_sd} if phase == "kill" else None
    run = Run(ModelLayout(), True, torch.float32, hf_sds, samples, with_weights=False)
    if phase == "kill":
        kill_phase(root, run)
    else:
        resume_phase(root, run)
    destroy()


if __name__ == "__main__":
    main()
