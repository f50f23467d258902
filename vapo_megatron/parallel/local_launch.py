"""Run one command as N local gloo ranks, bounded in time (tests, benchmarks, CPU tools).

Each rank is a plain subprocess with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set
(cheaper than torchrun, and a hang is killed by the timeout instead of blocking). Output goes
to files, not pipes, so a chatty rank cannot deadlock on a full pipe. On a cluster, use
torchrun or srun instead.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchError(RuntimeError):
    """A rank failed or the group timed out; the message holds every rank's log tail."""


def run_local_ranks(
    command: Sequence[str],
    world_size: int,
    *,
    timeout: float | None,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    threads_per_rank: int = 1,
) -> list[str]:
    """Run ``command`` as ``world_size`` ranks; return each rank's output (stdout + stderr)."""
    env_base = dict(os.environ if env is None else env)
    env_base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS=str(threads_per_rank),
    )
    logdir = Path(tempfile.mkdtemp(prefix="vapo_ranks_"))
    procs, logs = [], []
    for rank in range(world_size):
        rank_env = dict(env_base, RANK=str(rank), LOCAL_RANK=str(rank))
        log = open(logdir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(
            subprocess.Popen(
                list(command),
                env=rank_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=cwd,
            )  # fmt: skip
        )
    deadline = None if timeout is None else time.monotonic() + timeout
    timed_out = False
    # Poll every rank: the first one to fail stops the group (the others would wait on it).
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            break
        if deadline is not None and time.monotonic() > deadline:
            timed_out = True
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()
    for log in logs:
        log.close()
    outputs = [(logdir / f"rank{r}.log").read_text() for r in range(world_size)]
    if timed_out or any(p.returncode != 0 for p in procs):
        detail = "\n".join(
            f"----- rank {r} (rc={p.returncode}) -----\n{out[-6000:]}"
            for r, (p, out) in enumerate(zip(procs, outputs, strict=True))
        )
        why = f"timed out after {timeout:.0f}s" if timed_out else "a rank failed"
        raise LaunchError(f"{' '.join(command)} x{world_size}: {why}\n{detail}")
    return outputs
