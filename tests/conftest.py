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
    tools it starts (``TMPDIR``), is not left in /tmp. Torch's compile cache, which torch keeps
    in the temporary directory (precompiled headers: 149 MB after the vLLM tests, built with
    g++), stays the machine's one: a link to it, reused rather than rebuilt every session."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    root = tmp_path_factory.mktemp("TMPDIR")
    torch_cache = Path(default_cache_dir())  # under the real temporary directory, as yet
    torch_cache.mkdir(parents=True, exist_ok=True)
    (root / torch_cache.name).symlink_to(torch_cache, target_is_directory=True)
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = str(root)
    yield root
    if saved[0] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved[0]
    tempfile.tempdir = saved[1]
