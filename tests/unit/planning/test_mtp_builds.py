"""The planner's count of DeepSeek-V3's MTP layers against megatron's own build (issue 43):
``vapo-train --dry-run`` of a tiny DeepSeek-V3 with one MTP layer at world 8, the policy at
PP 2 x EP 2, with ``policy.mtp.loss_weight`` 0.1 (built and trained: counted on the last
stage, with its copy of the embedding) and 0 (carried as files: not built, not counted). The
first stage and the critic never change."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.planning.params import mtp_numels

REPO = Path(__file__).resolve().parents[3]
LAYOUTS = ["policy.layout.tp=1", "critic.layout.tp=1", "policy.layout.pp=2",
           "policy.layout.ep=2", "critic.layout.ep=2"]  # fmt: skip


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HFModelConfig]:
    from vapo_megatron.tiny.model import tiny_deepseek_v3_config, train_tokenizer

    tokenizer = train_tokenizer(["12+34=46"], vocab_size=280)
    config = tiny_deepseek_v3_config(tokenizer, num_layers=4).to_dict()
    config |= {"num_nextn_predict_layers": 1, "torch_dtype": "bfloat16"}
    path = tmp_path_factory.mktemp("policy") / "config.json"
    path.write_text(json.dumps(config))
    return path, HFModelConfig.from_hf(config)


def dry_run(model: Path, weight: float) -> dict:
    done = subprocess.run(
        [sys.executable, str(REPO / "vapo_megatron" / "train.py"),
         str(REPO / "recipes" / "tiny_cpu.yaml"), "--dry-run", "--world-size", "8",
         "--ranks", "0,7", "--model", str(model), "model.dtype=bfloat16", *LAYOUTS,
         f"policy.mtp.loss_weight={weight}"],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.unit
def test_mtp_layers_are_counted_where_they_are_built(policy) -> None:
    path, hf = policy
    built = {weight: dry_run(path, weight)["ranks"] for weight in (0.1, 0.0)}
    for ranks in built.values():
        for report in ranks:
            for role in ("policy", "critic"):
                model = report[role]
                assert model["param_count"] == model["planned_param_count"], (role, model)
                assert model["built_bytes"]["params"] == model["planned_bytes"]["params"]
    (first, last), (first0, last0) = built[0.1], built[0.0]
    assert last["policy"]["coords"]["pp"] == 1
    assert first["policy"]["param_count"] == first0["policy"]["param_count"]
    assert last["critic"]["param_count"] == last0["critic"]["param_count"]
    dense, expert = mtp_numels(hf, ModelLayout(pp=2, ep=2))
    embedding_copy = hf.padded_vocab_size(1) * hf.hidden_size
    added = last["policy"]["param_count"] - last0["policy"]["param_count"]
    assert added == sum(dense) + sum(expert) + embedding_copy
