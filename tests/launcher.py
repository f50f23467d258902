"""Run a worker script in several gloo processes, bounded in time.

Each rank is a plain subprocess with RANK/WORLD_SIZE/MASTER_* set (cheaper than torchrun,
and a hang is killed by the timeout instead of blocking CI). Output goes to files, not
pipes, so a chatty rank cannot deadlock on a full pipe.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(
    script: str | Path, world_size: int, *args: str, timeout: float = 240.0
) -> list[str]:
    """Run ``python script args...`` as ``world_size`` ranks; return each rank's output.

    Fails (AssertionError with every rank's log) if any rank exits non-zero or the whole
    group runs past ``timeout`` seconds.
    """
    port = free_port()
    env_base = dict(os.environ)
    env_base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO_ROOT) + os.pathsep + env_base.get("PYTHONPATH", ""),
        PYTHONWARNINGS="ignore::UserWarning",
    )
    logdir = Path(tempfile.mkdtemp(prefix="vapo_dist_"))
    procs, logs = [], []
    for rank in range(world_size):
        env = dict(env_base, RANK=str(rank), LOCAL_RANK=str(rank))
        log = open(logdir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=REPO_ROOT,
            )
        )
    deadline = time.monotonic() + timeout
    timed_out = False
    for p in procs:
        remaining = deadline - time.monotonic()
        try:
            p.wait(timeout=max(remaining, 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    if timed_out:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
    for log in logs:
        log.close()
    outputs = [(logdir / f"rank{r}.log").read_text() for r in range(world_size)]
    failed = timed_out or any(p.returncode != 0 for p in procs)
    if failed:
        detail = "\n".join(
            f"----- rank {r} (rc={p.returncode}) -----\n{out[-6000:]}"
            for r, (p, out) in enumerate(zip(procs, outputs, strict=True))
        )
        why = f"timed out after {timeout:.0f}s" if timed_out else "a rank failed"
        raise AssertionError(f"{script} x{world_size}: {why}\n{detail}")
    return outputs
