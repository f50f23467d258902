"""Parts that need more than the check's world of one launch their own ranks: a worker module
of ``gpu_checks`` run as N local processes by the project's launcher
(``launch/local_launch.py::run_local_ranks``: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
a free MASTER_PORT set; logs to files; a group past its timeout, or with a failed rank, is
killed). Each rank takes GPU LOCAL_RANK (``trainer/session.py::init_distributed``), NCCL on a
GPU, gloo with ``--cpu`` (CUDA stays hidden: the children inherit CUDA_VISIBLE_DEVICES="").

Every rank writes ``rank{r}.json`` into the run's directory; a rank that returns nothing (a
hang past the timeout, a crash) fails the part with the tail of its log, and the whole logs
go to stderr.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from gpu_checks.frame import CheckFailed
from vapo_megatron.launch.local_launch import LaunchError, run_local_ranks

TOOLS = Path(__file__).resolve().parents[1]
REPO_ROOT = TOOLS.parent


def run_ranks(module: str, world_size: int, workdir: Path, *args: str, timeout: float) -> list:
    """Run ``python -m gpu_checks.<module> WORKDIR ARGS...`` as ``world_size`` ranks; return
    each rank's ``rank{r}.json``. CheckFailed when a rank fails, hangs or writes nothing."""
    workdir.mkdir(parents=True, exist_ok=True)
    if torch.cuda.is_available():  # the children's engines want this process's cached blocks
        torch.cuda.empty_cache()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(TOOLS), env.get("PYTHONPATH", "")])
    env.setdefault("PYTHONWARNINGS", "ignore::UserWarning,ignore::FutureWarning")
    command = [sys.executable, "-m", f"gpu_checks.{module}", str(workdir), *args]
    try:
        run_local_ranks(command, world_size, timeout=timeout, env=env, cwd=REPO_ROOT,
                        log_dir=workdir / "logs")  # fmt: skip
    except LaunchError as err:
        print(str(err), file=sys.stderr, flush=True)
        codes = err.returncodes
        hung = "timed out" in str(err).splitlines()[0]
        why = f"timed out after {timeout:g} s (a rank hung)" if hung else f"exit codes {codes}"
        raise CheckFailed(f"{module} x{world_size}: {why}; {last_error(str(err))}") from None
    results = []
    for rank in range(world_size):
        path = workdir / f"rank{rank}.json"
        if not path.is_file():
            raise CheckFailed(f"{module}: rank {rank} exited 0 but returned nothing ({path})")
        results.append(json.loads(path.read_text()))
    return results


def last_error(log: str) -> str:
    """The last line of a traceback ('SomeError: ...') in ``log``, else its last line."""
    lines = [line for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":")[0] or "CheckFailed" in line]
    return (errors or lines or ["(no output)"])[-1].strip()[:400]


def write_result(workdir: str | Path, rank: int, result: dict) -> None:
    """A worker's result for the part (numbers, JSON-able)."""
    Path(workdir, f"rank{rank}.json").write_text(json.dumps(result, default=str))
