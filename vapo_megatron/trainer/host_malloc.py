"""glibc's malloc told to keep the heap a step frees, so the next step does not fault it in again.

A step's host bookkeeping allocates and frees hundreds of MB of mid-sized blocks (micro-batch
rows, GAE's blocks, metric buffers; each under 32 MiB). By default glibc starts with a 128 KiB
mmap threshold that it raises only as big blocks are freed, and gives the top of the heap back
to the kernel once more than twice that threshold lies free there (at most 64 MiB), so every
step faults the same pages in again and the kernel zeroes each one first. Measured with
``tools/bench.py scale --mixed`` on the 2-core CPU VM (2,048 samples; docs/benchmarks.md):
~0.95M minor faults a run and ~4 s of system time by default, ~0.55M and ~2.9 s with the
settings below, peak host memory within 0.1 GB of the default.

The settings, applied once per process with ``mallopt`` (glibc reads its ``MALLOC_*_``
environment only at start-up, too late for a process that is already running):

- ``M_MMAP_THRESHOLD`` 32 MiB, where glibc's own dynamic threshold ends up: blocks below it
  come from the heap, so freed ones are reused; bigger ones (the step's whole-step arrays, the
  offload arenas) stay separate mappings, given back to the kernel when freed.
- ``M_TRIM_THRESHOLD`` 512 MiB: the heap keeps up to that much free at its top instead of
  returning it. It holds pages the step touched anyway, so the peak barely moves; the cost is
  that a rank's resident memory does not fall below its step's working set between steps.

Setting either threshold turns glibc's dynamic adjustment off, which is why both are set
(``M_TRIM_THRESHOLD`` alone leaves the mmap threshold at 128 KiB: twice the faults, measured).
A user's own ``MALLOC_*`` or ``glibc.malloc`` tunables win: nothing is changed then.

The step's whole-step arrays (token ids, log-probs, values and advantages of every token a rank
holds: ~170 MB each at the 32B step's 42M tokens on a DP1 rank) are above any mmap threshold
glibc allows (32 MiB at most), so each is a fresh mapping every step, and the kernel zeroes
every page of it again: ~390k faults and ~2 s of system time a step on the CPU VM at 8,192
samples, measured (``tools/bench_scale.py 8192 mixed``). ``step_heap()`` turns mmap off
(``M_MMAP_MAX`` 0) around the step's bookkeeping only, so those arrays come from the heap, and
the next step reuses the pages they freed. Outside it (generation, the offload arenas, weight
sync, checkpoints) big blocks are separate mappings again, given back when freed. The heap
keeps at most the trim threshold free at its top; free blocks below the top stay with the
process for the next step's arrays.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
from collections.abc import Iterator, Mapping

logger = logging.getLogger("vapo_megatron")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
"""glibc's ``mallopt`` parameter numbers (``malloc.h``)."""
DEFAULT_MMAP_MAX = 65536
"""glibc's ``DEFAULT_MMAP_MAX``: the most mappings malloc keeps at once (restored after a step)."""
MMAP_THRESHOLD_BYTES = 32 << 20
"""glibc's ``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit: the most its dynamic threshold reaches."""
TRIM_THRESHOLD_BYTES = 512 << 20

_USER_SETTINGS = (
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
)


def user_malloc_setting(environ: Mapping[str, str]) -> str | None:
    """The environment variable by which the user tuned malloc themselves (theirs wins), or
    None."""
    for name in _USER_SETTINGS:
        if name in environ:
            return name
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return None


def keep_freed_heap(environ: Mapping[str, str] = os.environ) -> bool:
    """Apply the settings above to this process's glibc malloc. True when applied; False (and
    a log line saying why) on another C library or platform, or where the user's environment
    tunes malloc already."""
    own = user_malloc_setting(environ)
    if own is not None:
        logger.info("host malloc: left as %s sets it", own)
        return False
    if not sys.platform.startswith("linux"):
        logger.info("host malloc: %s is not Linux; left as it is", sys.platform)
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        logger.info("host malloc: no mallopt in this process's C library; left as it is")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    global _MALLOPT
    applied = (
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    )
    if applied:
        _MALLOPT = mallopt
        logger.debug(
            "host malloc: mmap threshold %d MiB, trim threshold %d MiB",
            MMAP_THRESHOLD_BYTES >> 20, TRIM_THRESHOLD_BYTES >> 20,
        )  # fmt: skip
    else:  # musl's mallopt, for one, accepts nothing
        logger.info("host malloc: mallopt refused the thresholds; left as it is")
    return applied


_MALLOPT = None
"""glibc's ``mallopt`` once ``keep_freed_heap`` applied its settings in this process, else None."""
_DEPTH = 0


@contextlib.contextmanager
def step_heap() -> Iterator[None]:
    """Within it, every allocation comes from the heap (mmap off), so the step's whole-step
    arrays reuse the pages the previous step freed. Does nothing unless ``keep_freed_heap``
    applied its settings in this process (the user's own malloc settings win here too).
    Re-entrant: the outermost exit restores glibc's default."""
    global _DEPTH
    if _MALLOPT is None:
        yield
        return
    if _DEPTH == 0:
        _MALLOPT(M_MMAP_MAX, 0)
    _DEPTH += 1
    try:
        yield
    finally:
        _DEPTH -= 1
        if _DEPTH == 0:
            _MALLOPT(M_MMAP_MAX, DEFAULT_MMAP_MAX)
