"""Run one command as N local gloo ranks, bounded in time (tests, benchmarks, CPU tools).

Each rank is a plain subprocess with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set
(cheaper than torchrun, and a hang is killed by the timeout instead of blocking). Output goes
to files, not pipes, so a chatty rank cannot deadlock on a full pipe. On a cluster, use
torchrun or srun instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from vapo_megatron.launch.host_malloc import launch_tunables


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchError(RuntimeError):
    """A rank failed or the group timed out; the message holds every rank's log tail."""

    def __init__(self, message: str, returncodes: Sequence[int | None] = ()) -> None:
        super().__init__(message)
        self.returncodes = list(returncodes)
        """Each rank's exit status (negative: killed by that signal)."""


def run_local_ranks(
    command: Sequence[str],
    world_size: int,
    *,
    timeout: float | None,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    threads_per_rank: int = 1,
    console_rank: int | None = None,
    log_dir: str | Path | None = None,
) -> list[str]:
    """Run ``command`` as ``world_size`` ranks; return each rank's output (stdout + stderr).

    ``console_rank``: that rank writes to this process's stdout/stderr (a user watching a
    run sees its progress) instead of a file; its returned output is "". ``log_dir``: where
    the other ranks' stdout and stderr go and stay, ``rank{r}.console.log`` (beside the
    ``rank{r}.log`` that every rank of vapo-train writes itself, ``run_log``); default: a
    temporary directory, removed before returning (the outputs, and a ``LaunchError``'s
    message, carry what the ranks printed).
    """
    with contextlib.ExitStack() as scratch:
        if log_dir is None:
            log_dir = scratch.enter_context(tempfile.TemporaryDirectory(prefix="vapo_ranks_"))
        return _run_ranks(command, world_size, timeout, env, cwd, threads_per_rank,
                          console_rank, Path(log_dir))  # fmt: skip


def _run_ranks(
    command: Sequence[str],
    world_size: int,
    timeout: float | None,
    env: dict[str, str] | None,
    cwd: str | Path | None,
    threads_per_rank: int,
    console_rank: int | None,
    logdir: Path,
) -> list[str]:
    env_base = dict(os.environ if env is None else env)
    env_base.update(
        # glibc reads it at start only: huge pages for malloc's mappings (launch/host_malloc.py)
        GLIBC_TUNABLES=launch_tunables(env_base.get("GLIBC_TUNABLES")),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        # The separate placement's rollout ranks' own world and the bridge between the two
        # (parallel/placement.py); unused otherwise.
        VAPO_ROLLOUT_PORT=str(free_port()),
        VAPO_BRIDGE_PORT=str(free_port()),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS=str(threads_per_rank),
    )
    logdir.mkdir(parents=True, exist_ok=True)
    procs, logs = _start_ranks(command, world_size, env_base, cwd, console_rank, logdir)
    timed_out = _wait_for_ranks(procs, timeout)
    for log in logs:
        if log is not None:
            log.close()
    outputs = [
        "" if r == console_rank else console_file(logdir, r).read_text() for r in range(world_size)
    ]
    if timed_out or any(p.returncode != 0 for p in procs):
        detail = "\n".join(
            f"----- rank {r} (rc={p.returncode}) -----\n{out[-6000:]}"
            for r, (p, out) in enumerate(zip(procs, outputs, strict=True))
        )
        why = f"timed out after {timeout:.0f}s" if timed_out else "a rank failed"
        raise LaunchError(
            f"{' '.join(command)} x{world_size}: {why}\n{detail}", [p.returncode for p in procs]
        )
    return outputs


def _start_ranks(
    command: Sequence[str],
    world_size: int,
    env_base: dict[str, str],
    cwd: str | Path | None,
    console_rank: int | None,
    logdir: Path,
) -> tuple[list[subprocess.Popen], list]:
    """Start every rank (RANK and LOCAL_RANK set); each prints to its console file, or to this
    console for ``console_rank``. Returns the processes and their open log files (None for
    the console's)."""
    procs, logs = [], []
    for rank in range(world_size):
        rank_env = dict(env_base, RANK=str(rank), LOCAL_RANK=str(rank))
        to_console = rank == console_rank
        log = None if to_console else open(console_file(logdir, rank), "w")  # noqa: SIM115
        logs.append(log)
        procs.append(
            subprocess.Popen(
                list(command),
                env=rank_env,
                stdout=None if to_console else log,
                stderr=None if to_console else subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=cwd,
                preexec_fn=die_with_launcher if sys.platform == "linux" else None,
            )  # fmt: skip
        )
    return procs, logs


def die_with_launcher() -> None:
    """In a rank, between fork and exec (Linux): ask the kernel to SIGKILL it when the launcher
    dies (``PR_SET_PDEATHSIG``), so a launcher killed by ``kill -9`` or a timeout leaves no
    ranks behind, waiting in a collective and holding their ports (and on a GPU, memory)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:  # Popen re-raises it
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _wait_for_ranks(procs: list[subprocess.Popen], timeout: float | None) -> bool:
    """Wait until every rank is done, one has failed or ``timeout`` seconds have passed; kill
    the ones still running. Returns whether the group timed out."""
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
    return timed_out


def console_file(log_dir: Path, rank: int) -> Path:
    """Where a rank that is not on this console prints (its stdout and stderr)."""
    return log_dir / f"rank{rank}.console.log"


def under_launcher() -> bool:
    """Whether this process is one rank of a launched group (torchrun, srun, run_local_ranks)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def relaunch_as_local_ranks(world_size: int, *, log_dir: str | Path | None = None) -> int:
    """Start this very command (``sys.executable sys.argv``) as ``world_size`` local gloo
    ranks, rank 0 on this console and the others printing to ``log_dir``; return an exit code.

    For command-line tools started plainly; under torchrun/srun each process is already a rank.
    """
    try:
        run_local_ranks(
            [sys.executable, *sys.argv],
            world_size,
            timeout=None,
            threads_per_rank=int(os.environ.get("OMP_NUM_THREADS", "1")),
            console_rank=0,
            log_dir=log_dir,
        )
    except LaunchError as err:
        print(str(err), file=sys.stderr)
        # The first rank that failed by itself (the others were killed after it).
        return next((code for code in err.returncodes if code and code > 0), 1)
    return 0
