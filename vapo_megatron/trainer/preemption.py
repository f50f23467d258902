"""Save before the scheduler kills the job: catch SIGTERM / SIGUSR1, agree at a step boundary.

Slurm sends SIGTERM (or, with ``--signal=USR1@120``, SIGUSR1 ahead of time) to every task, but
not at the same instant, and a rank that stopped alone would hang the others in a collective.
So the handler only records the signal; at the end of each step the trainer asks
:meth:`PreemptionFlag.should_save`, an all-reduce (MAX) over the group, and every rank saves
and exits at the same step once any of them was signalled.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from vapo_megatron.parallel import collectives

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionFlag:
    """Records the first of ``signals`` this process receives (install in the main thread)."""

    def __init__(self, signals: Iterable[signal.Signals] = DEFAULT_SIGNALS) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionFlag must be created in the main thread (signal rule)")
        self.received: signal.Signals | None = None
        """The signal received, None until one arrives."""
        self._previous: dict[signal.Signals, Any] = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
        # A handler someone installed before us (a logger flushing, another library) still
        # runs. The defaults are not chained: SIG_DFL would end the process before the save.
        previous = self._previous.get(signal.Signals(signum))
        if callable(previous):
            previous(signum, frame)

    def should_save(self, group: dist.ProcessGroup | None = None) -> bool:
        """Whether any rank of ``group`` was signalled (collective: call it on every rank)."""
        flag = torch.tensor(
            [0 if self.received is None else 1], device=collectives.group_device(group)
        )
        collectives.all_reduce(flag, group, dist.ReduceOp.MAX)
        return bool(flag.item())

    def uninstall(self) -> None:
        """Put the previous handlers back (main thread)."""
        for sig, previous in self._previous.items():
            # None: the previous handler was not installed from Python; the default is closest.
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()
