import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# One thread per process: tests and distributed workers share 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def session_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The system's temporary directory, for the session: a directory under pytest's own,
    which pytest prunes (it keeps the last three sessions'). Whatever the suite, the product or
    a library (vLLM's sockets) puts there, in this process (``tempfile``) and in the ranks and
    tools it starts (``TMPDIR``), is not left in /tmp. Torch's compile cache stays where torch
    keeps it between runs: a cache (149 MB of precompiled headers after the vLLM tests), reused
    rather than rebuilt every session."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    root = tmp_path_factory.mktemp("TMPDIR")
    saved = {k: os.environ.get(k) for k in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR")}
    saved_tempdir = tempfile.tempdir
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    os.environ["TMPDIR"] = tempfile.tempdir = str(root)
    yield root
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    tempfile.tempdir = saved_tempdir
