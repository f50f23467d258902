"""Where a rank's log lines go: the run's own to the console, everything to the rank's log file.

The console (stderr) shows the project's lines (the root logger the entry points use and
``vapo_megatron.*``) at the rank's level (INFO on rank 0, WARNING on the others) and every
library's errors; the step lines and the progress bar are printed, not logged. The rank's log
file, ``RUN_DIR/logs/rank{r}.log`` (:func:`open_rank_log`), gets every line at INFO and above:
the project's and the libraries' (vLLM, megatron, torch, transformers, ... through their
loggers; Python warnings through ``logging.captureWarnings``). A library's warning says
nothing a user must act on in almost every run (Triton without a CPU backend, NUMA binding,
LD_PRELOAD advice, megatron's FSDP detection), so it does not belong on the console.

Library lines logged before the run directory is known (imports, recipe loading) are held, up
to ``HELD_RECORDS``, and written when the file opens; a process that never opens one (the
plain ``vapo-train`` that starts the local ranks, a dry run) drops them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

PROJECT_LOGGERS = ("root", "__main__", "vapo_megatron")
"""Loggers whose lines are the run's own (and their children)."""

HARMLESS_VLLM_WARNINGS = (
    "RotaryEmbedding: Failed to load weights",  # each sync: RoPE has no weights to load
    "doesn't allow to use `torch.set_num_threads`",  # CPU: threads are bound at start-up
)
"""vLLM warnings that each step would repeat and that say nothing about the run: dropped."""

HELD_RECORDS = 10_000
"""Library lines held until the rank's log file opens; later ones are counted, not kept."""

DATE_FORMAT = "%H:%M:%S"


def quiet_dependencies() -> None:
    """Hide notes that say nothing about the run (absent TE/apex, deprecations in megatron)."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).* not installed")
    warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")


def is_project_record(record: logging.LogRecord) -> bool:
    name = record.name
    return any(name == p or name.startswith(p + ".") for p in PROJECT_LOGGERS)


def _not_harmless(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not any(text in message for text in HARMLESS_VLLM_WARNINGS)


class ConsoleFilter(logging.Filter):
    """The project's lines at ``level`` and above; anyone's errors."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        return is_project_record(record) and record.levelno >= self.level


class RankLogHandler(logging.Handler):
    """Writes to the rank's log file once :meth:`open` names it; holds records until then."""

    def __init__(self, rank: int) -> None:
        super().__init__(logging.INFO)
        self.rank = rank
        self.held: list[logging.LogRecord] = []
        self.dropped = 0
        self.file: logging.FileHandler | None = None
        self.addFilter(_not_harmless)

    @property
    def path(self) -> Path | None:
        return None if self.file is None else Path(self.file.baseFilename)

    def open(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        file = logging.FileHandler(path, mode="a", encoding="utf-8")
        file.setFormatter(
            logging.Formatter(
                f"%(asctime)s [rank {self.rank}] %(levelname)s %(name)s: %(message)s",
                datefmt=DATE_FORMAT,
            )
        )
        if self.file is not None:  # a second run in this process: its own directory
            self.file.close()
        self.file = file
        for record in self.held:
            file.handle(record)
        if self.dropped:
            file.stream.write(f"({self.dropped} earlier library lines were not kept)\n")
        self.held, self.dropped = [], 0

    def emit(self, record: logging.LogRecord) -> None:
        if self.file is not None:
            self.file.handle(record)
        elif len(self.held) < HELD_RECORDS:
            self.held.append(record)
        else:
            self.dropped += 1

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        super().close()


_rank_log: RankLogHandler | None = None


def setup_logging(*, route_transformers: bool = True) -> None:
    """The console and the rank's log file (once :func:`open_rank_log` names it) for this
    process; the rank comes from ``RANK`` (0 when unset). ``route_transformers=False``: a
    process that never imports transformers (vapo-train's launcher: it only checks the recipe
    and starts the ranks) does not pay seconds to import it here."""
    global _rank_log
    rank = int(os.environ.get("RANK", "0"))
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.setLevel(logging.INFO)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(
        logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", DATE_FORMAT)
    )
    console.addFilter(ConsoleFilter(logging.INFO if rank == 0 else logging.WARNING))
    console.addFilter(_not_harmless)
    _rank_log = RankLogHandler(rank)
    root.addHandler(console)
    root.addHandler(_rank_log)
    logging.captureWarnings(True)  # Python warnings become records of logger "py.warnings"
    # vLLM's INFO notes repeat every step (prefix-cache resets after each sync): warnings only.
    logging.getLogger("vllm").setLevel(logging.WARNING)
    if route_transformers:
        _route_transformers()


def _route_transformers() -> None:
    """transformers writes to stderr through a handler of its own and stops propagation: send
    its lines through the root logger's handlers instead."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()


def open_rank_log(log_dir: Path) -> Path:
    """Start writing this rank's log file, ``log_dir/rank{r}.log`` (appended to: a resumed run
    continues it), with the lines held so far. Returns its path."""
    if _rank_log is None:
        raise ValueError("open_rank_log before setup_logging: call setup_logging() first")
    path = Path(log_dir) / f"rank{_rank_log.rank}.log"
    _rank_log.open(path)
    return path


@contextlib.contextmanager
def native_stderr_to_rank_log() -> Iterator[None]:
    """Within: what native code writes to stderr (file descriptor 2) goes to the rank's log file
    instead of the console, e.g. vLLM-CPU's C++ note on NUMA memory binding at engine start.
    Python lines logged meanwhile go there too. Does nothing before :func:`open_rank_log`."""
    path = None if _rank_log is None else _rank_log.path
    if path is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "a", encoding="utf-8") as log:
            os.dup2(log.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
