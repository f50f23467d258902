"""Run a worker script in several gloo processes, bounded in time (see ``local_launch``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from vapo_megatron.launch.local_launch import LaunchError, run_local_ranks

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_workers(
    script: str | Path, world_size: int, *args: str, timeout: float = 240.0
) -> list[str]:
    """Run ``python script args...`` as ``world_size`` ranks; return each rank's output.

    Fails (AssertionError with every rank's log) if any rank exits non-zero or the whole
    group runs past ``timeout`` seconds.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONWARNINGS"] = "ignore::UserWarning,ignore::FutureWarning"
    try:
        return run_local_ranks(
            [sys.executable, str(script), *args],
            world_size,
            timeout=timeout,
            env=env,
            cwd=REPO_ROOT,
        )
    except LaunchError as err:
        raise AssertionError(str(err)) from None
