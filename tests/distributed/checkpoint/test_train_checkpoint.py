"""A training checkpoint resumes bit for bit (TP2 plain optimizer, DP2 distributed optimizer,
fp32 and bf16, policy and critic, saved synchronously or in the background); half-written
saves are never loaded; keep_last prunes; the preemption flag agrees across ranks;
`tools/convert.py mcore-to-hf` exports a saved step (see the worker's docstring)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.launcher import REPO_ROOT, run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "train_checkpoint_worker.py"


@pytest.mark.parametrize(
    "cases",
    [
        "TP2,DP2-distopt-bf16",
        pytest.param("DP2-distopt,TP2-bf16", marks=pytest.mark.slow),  # CI time
        "TP2-async,DP2-distopt-bf16-async",
    ],
)
def test_resume_is_bit_identical(cases, tmp_path):
    outputs = run_workers(WORKER, 2, cases, str(tmp_path), timeout=300)
    for name in cases.split(","):
        for rank in (0, 1):
            assert f"rank {rank}: {name}: resumed bit-identical" in outputs[rank]
            if name.endswith("-async"):  # written in the background while steps 3-4 ran
                assert f"rank {rank}: {name}: published after steps 3-4" in outputs[rank]
    assert all("preemption flag agreed" in out for out in outputs)
    if "TP2" not in cases.split(","):
        return
    # The step's reshardable policy weights export to HF equal to the trained engine's.
    out = tmp_path / "hf_export"
    ckpt = tmp_path / "TP2" / "step_00000004" / "policy" / "weights"
    convert = [sys.executable, str(REPO_ROOT / "tools" / "convert.py"), "mcore-to-hf"]
    subprocess.run([*convert, "--ckpt", str(ckpt), "--out", str(out)], check=True, timeout=120)
    exported = {}
    for shard in out.glob("*.safetensors"):
        exported.update(load_file(shard))
    want = torch.load(tmp_path / "TP2" / "policy_hf_step4.pt")
    assert sorted(exported) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(exported[name], tensor), name
