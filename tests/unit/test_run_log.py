"""``run_log``: the console holds the run's own lines and every error; the rank's log file
holds everything, lines from before it opened and native stderr included.

Each case runs in a fresh interpreter: ``setup_logging`` takes over the root logger, which
pytest's own log capture uses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.launcher import REPO_ROOT

pytestmark = pytest.mark.unit

SCRIPT = textwrap.dedent(
    """
    import logging, os, sys, warnings
    from pathlib import Path
    from vapo_megatron.run_log import native_stderr_to_rank_log, open_rank_log, setup_logging

    setup_logging()
    logging.info("run line before the file")
    logging.getLogger("vapo_megatron.trainer").warning("run warning")
    logging.getLogger("vllm.platforms").warning("library warning before the file")
    logging.getLogger("megatron.core.optimizer").info("library info")
    warnings.warn("a python warning")
    from transformers.utils import logging as hf_logging  # as the trainer's imports do
    hf_logging.get_logger("transformers.tokenization_utils").warning("transformers warning")
    open_rank_log(Path(sys.argv[1]))
    logging.getLogger("vllm.worker").error("library error")
    logging.getLogger("vllm.worker").warning("RotaryEmbedding: Failed to load weights")
    with native_stderr_to_rank_log():
        os.write(2, b"native note\\n")
    logging.info("run line after")
    """
)


def run(tmp_path: Path, rank: int) -> tuple[str, str]:
    env = {**os.environ, "RANK": str(rank), "PYTHONPATH": str(REPO_ROOT)}
    env.pop("PYTHONWARNINGS", None)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "logs")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stderr, (tmp_path / "logs" / f"rank{rank}.log").read_text()


def test_rank0_console_and_log_file(tmp_path):
    console, log = run(tmp_path, 0)
    lines = [line.split(" ", 1)[1] for line in console.splitlines()]
    assert lines == [
        "[rank 0] INFO run line before the file",
        "[rank 0] WARNING run warning",
        "[rank 0] ERROR library error",
        "[rank 0] INFO run line after",
    ]
    for text in (
        "INFO root: run line before the file",
        "WARNING vllm.platforms: library warning before the file",
        "INFO megatron.core.optimizer: library info",
        "WARNING py.warnings: ",
        "UserWarning: a python warning",
        "WARNING transformers.tokenization_utils: transformers warning",
        "ERROR vllm.worker: library error",
        "native note",
        "INFO root: run line after",
    ):
        assert text in log, text
    assert "RotaryEmbedding" not in log + console  # repeated every step, says nothing


def test_other_ranks_console_has_warnings_and_errors_only(tmp_path):
    console, log = run(tmp_path, 1)
    lines = [line.split(" ", 1)[1] for line in console.splitlines()]
    assert lines == ["[rank 1] WARNING run warning", "[rank 1] ERROR library error"]
    assert "[rank 1] INFO root: run line after" in log and "native note" in log
