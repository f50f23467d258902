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
glibc allows (32 MiB at most), so each is a fresh mapping every step, given back when freed,
whose pages the kernel zeroes and faults in again: ~390k faults a step with 4 KiB pages on the
CPU VM at 8,192 samples (``tools/bench_scale.py 8192 mixed``). The ranks are therefore launched
with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (``launch_tunables``: ``launch/local_launch.py``
and ``slurm/common.sh`` set it; the user's own ``glibc.malloc.hugetlb`` wins): glibc then
``madvise``s its mappings for transparent huge pages, so the kernel maps them 2 MiB at a time
(~7k faults a step, measured) where THP is ``madvise`` or ``always``. glibc reads the tunable
only at process start, which is why it travels in the environment and is not set here.

Tried and removed (docs/benchmarks.md, 2026-12-06): taking the whole-step arrays from the heap
(``M_MMAP_MAX`` 0 around the step) saved the faults too, but the heap fragments around them: a
rank's resident memory climbed step after step (to a 2.15-2.40 GB peak over 12 steps at 8,192
samples, with ~1.1 GB in use at the peak), where mappings given back each step hold it at
1.6-1.7 GB.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Mapping

logger = logging.getLogger("vapo_megatron")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter numbers (``malloc.h``)."""
MMAP_THRESHOLD_BYTES = 32 << 20
"""glibc's ``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit: the most its dynamic threshold reaches."""
TRIM_THRESHOLD_BYTES = 512 << 20

_USER_SETTINGS = (
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
)
HUGEPAGE_TUNABLE = "glibc.malloc.hugetlb"
"""glibc's (2.35+) tunable: 1 makes malloc ``madvise`` its memory for transparent huge pages.
Older glibc ignores tunables it does not know."""


def tunable_names(tunables: str) -> list[str]:
    """The names a ``GLIBC_TUNABLES`` value sets (``name=value`` entries joined by ``:``)."""
    return [entry.split("=", 1)[0].strip() for entry in tunables.split(":") if entry.strip()]


def launch_tunables(tunables: str | None) -> str:
    """The ``GLIBC_TUNABLES`` a trainer rank starts with: ``tunables`` (the launcher's own
    value, or None) with ``glibc.malloc.hugetlb=1`` added, unless it names that tunable
    already (then the user's choice stands, ``=0`` included)."""
    tunables = tunables or ""
    if HUGEPAGE_TUNABLE in tunable_names(tunables):
        return tunables
    return f"{tunables}:{HUGEPAGE_TUNABLE}=1" if tunables else f"{HUGEPAGE_TUNABLE}=1"


def user_malloc_setting(environ: Mapping[str, str]) -> str | None:
    """The environment variable by which the user tuned malloc themselves (theirs wins), or
    None."""
    for name in _USER_SETTINGS:
        if name in environ:
            return name
    names = tunable_names(environ.get("GLIBC_TUNABLES", ""))
    if any(n.startswith("glibc.malloc.") and n != HUGEPAGE_TUNABLE for n in names):
        return "GLIBC_TUNABLES"  # huge pages alone are the launchers' (launch_tunables)
    return None


def keep_freed_heap(environ: Mapping[str, str] = os.environ) -> bool:
    """Apply the settings above to this process's glibc malloc. True when applied; False (and
    a log line saying why) on another C library or platform, or where the user's environment
    tunes malloc already."""
    if HUGEPAGE_TUNABLE not in tunable_names(environ.get("GLIBC_TUNABLES", "")):
        logger.info(
            "host malloc: started without GLIBC_TUNABLES=%s=1 (vapo-train's local ranks and "
            "slurm/ set it; export it where you launch ranks yourself): unless THP is 'always', "
            "the kernel faults each step's big host arrays in 4 KiB pages", HUGEPAGE_TUNABLE,
        )  # fmt: skip
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
    applied = (
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    )
    if applied:
        logger.debug(
            "host malloc: mmap threshold %d MiB, trim threshold %d MiB",
            MMAP_THRESHOLD_BYTES >> 20, TRIM_THRESHOLD_BYTES >> 20,
        )  # fmt: skip
    else:  # musl's mallopt, for one, accepts nothing
        logger.info("host malloc: mallopt refused the thresholds; left as it is")
    return applied
