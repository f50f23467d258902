"""A critic smaller than the policy through tools/convert.py: the tiny reward model (1 layer,
half the tiny policy's width, the policy's tokenizer; tiny/reward_model.py) converts at TP 2
from its own config, its values equal transformers' ``Qwen2ForSequenceClassification`` score at
every token, and it exports back bit-identical."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.launcher import REPO_ROOT
from vapo_megatron.tiny.reward_model import write_tiny_reward_model
from vapo_megatron.weights.hf_io import HFCheckpoint

pytestmark = pytest.mark.integration
CONVERT = REPO_ROOT / "tools" / "convert.py"
POLICY = REPO_ROOT / "vapo_megatron" / "tiny" / "demo" / "model"


def convert(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CONVERT), *map(str, args)], capture_output=True, text=True,
        timeout=300, cwd=REPO_ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip


def tensors(path: Path) -> dict[str, torch.Tensor]:
    checkpoint = HFCheckpoint(path)
    return dict(checkpoint.read(checkpoint.names))


def test_small_critic_converts_verifies_and_round_trips(tmp_path):
    rm = write_tiny_reward_model(tmp_path / "rm", POLICY, seed=1)
    rm_config, policy_config = (json.loads((p / "config.json").read_text()) for p in (rm, POLICY))
    assert (rm_config["num_hidden_layers"], rm_config["hidden_size"]) == (1, 64)
    assert (policy_config["num_hidden_layers"], policy_config["hidden_size"]) == (2, 128)
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    saved = convert("hf-to-mcore", "--hf", rm, "--out", mcore, "--tp", 2, "--critic-from",
                    "reward-model")  # fmt: skip
    assert saved.returncode == 0, saved.stderr[-3000:]
    verified = convert("verify", "--hf", rm, "--ckpt", mcore, "--tp", 2)
    assert verified.returncode == 0, verified.stderr[-3000:]
    report = json.loads(verified.stdout.strip().splitlines()[-1])
    assert report["passed"] and report["max_abs_diff"] < 1e-4, report
    exported = convert("mcore-to-hf", "--ckpt", mcore, "--out", back)
    assert exported.returncode == 0, exported.stderr[-3000:]
    original, returned = tensors(rm), tensors(back)
    assert returned.keys() == original.keys()
    assert all(torch.equal(returned[k], v) for k, v in original.items())
    assert json.loads((back / "config.json").read_text()) == rm_config
    assert (back / "tokenizer.json").read_bytes() == (POLICY / "tokenizer.json").read_bytes()
