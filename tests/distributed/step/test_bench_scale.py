"""``tools/bench.py scale --quick`` runs the trainer's step on 2 gloo ranks at a small step and
ends with its JSON line (``--mixed``: the policy TP2 x the critic DP2, on the routed path);
``gae --quick`` reports the step-shape GAE against a memcpy."""

import json
import subprocess
import sys

import pytest

from tests.launcher import REPO_ROOT

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("bench", ["scale", "scale --mixed", "gae"])
def test_bench_quick(bench):
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "bench.py"), *bench.split(), "--quick"],
        capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)
    assert summary["bench"] == bench.split()[0]
    if bench.startswith("scale"):
        mixed = bench.endswith("--mixed")
        assert summary["mixed"] == mixed and summary["path"] == ("routed" if mixed else "shards")
        assert summary["samples"] == 8192 and summary["measured_samples"] == 256
        assert summary["bookkeeping_s_per_step"] > 0 and summary["host_gb_per_rank"] > 0
        assert summary["response_tokens"] > 8192 * 1000
        assert "peak host GB per rank after each step: " in result.stdout
    else:
        assert summary["step_samples"] == 512 and summary["step_gae_s"] > 0
        assert summary["step_memcpy_s"] > 0
