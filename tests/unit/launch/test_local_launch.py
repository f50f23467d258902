"""``launch/local_launch.py`` leaves nothing in the temporary directory.

A launch without ``log_dir`` keeps its ranks' logs in a temporary directory only while it runs:
the outputs (or the error) carry them, and the directory is gone afterwards, whether the ranks
passed or failed. With ``log_dir`` the logs stay there.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

from vapo_megatron.launch.local_launch import LaunchError, run_local_ranks

pytestmark = pytest.mark.unit


@pytest.fixture
def system_tmp(tmp_path, monkeypatch):
    """A fresh directory standing for the system's temporary directory."""
    root = tmp_path / "system_tmp"
    root.mkdir()
    monkeypatch.setenv("TMPDIR", str(root))
    monkeypatch.setattr(tempfile, "tempdir", str(root))  # gettempdir() caches it
    return root


def rank_says(text: str, code: int = 0, failing_rank: int | None = None) -> list[str]:
    """Every rank prints ``text`` and its rank; it exits with ``code`` (only ``failing_rank``
    does, when given; the others exit 0)."""
    exit_code = code if failing_rank is None else f"{code} if r == '{failing_rank}' else 0"
    script = f"import os, sys; r = os.environ['RANK']; print({text!r}, r); sys.exit({exit_code})"
    return [sys.executable, "-c", script]


def test_a_launch_without_log_dir_leaves_nothing_behind(system_tmp):
    outputs = run_local_ranks(rank_says("hello"), 2, timeout=60)
    assert outputs == ["hello 0\n", "hello 1\n"]
    assert list(system_tmp.iterdir()) == []


def test_a_failed_launch_leaves_nothing_behind_and_reports_the_logs(system_tmp):
    # Only rank 1 fails, so it always runs to its end and prints: had both failed, the first
    # to exit would stop the group and the other could be killed before printing (a machine
    # under load did that once).
    with pytest.raises(LaunchError, match="a rank failed(.|\n)*broken 1") as caught:
        run_local_ranks(rank_says("broken", code=3, failing_rank=1), 2, timeout=60)
    assert caught.value.returncodes[1] == 3
    assert list(system_tmp.iterdir()) == []


def test_log_dir_keeps_the_logs(system_tmp, tmp_path):
    logs = tmp_path / "run" / "logs"
    run_local_ranks(rank_says("kept"), 2, timeout=60, log_dir=logs)
    assert sorted(p.name for p in logs.iterdir()) == ["rank0.console.log", "rank1.console.log"]
    assert (logs / "rank1.console.log").read_text() == "kept 1\n"
    assert list(system_tmp.iterdir()) == []


def test_the_suite_gives_ranks_a_temporary_directory_of_its_own(session_tmpdir):
    # tests/conftest.py: ranks and tools the suite starts make their temporaries under pytest's
    # directory, which pytest prunes, not in /tmp.
    (output,) = run_local_ranks(
        [sys.executable, "-c", "import tempfile; print(tempfile.mkdtemp(prefix='rank_'))"],
        1,
        timeout=60,
    )
    made = Path(output.strip())
    assert made.parent == session_tmpdir and made.is_dir()
    made.rmdir()


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_die_with_a_killed_launcher(tmp_path):
    """A launcher killed by ``kill -9`` (or a test's timeout) takes its ranks with it: before,
    ranks waiting in a collective lived on, holding their ports (seen: 55 minutes)."""
    import os
    import signal
    import subprocess
    import time

    pids = tmp_path / "pids"
    pids.mkdir()
    rank = f"import os, time; open({str(pids)!r} + '/' + str(os.getpid()), 'w'); time.sleep(120)"
    launcher = (
        "from vapo_megatron.launch.local_launch import run_local_ranks; import sys; "
        f"run_local_ranks([sys.executable, '-c', {rank!r}], 2, timeout=120)"
    )
    proc = subprocess.Popen([sys.executable, "-c", launcher])
    deadline = time.monotonic() + 60
    while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    started = [int(p.name) for p in pids.iterdir()]
    assert len(started) == 2, started
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    def alive(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            return False
        return state != "Z"  # a zombie has exited

    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in started if alive(pid)], "ranks outlived their launcher"
