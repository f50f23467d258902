"""critic.create_tiny: the tiny reward model is 1 layer of half the policy's width with the
policy's tokenizer, seeded, written once at critic.model (tiny/reward_model.py)."""

import json

import pytest
import torch
import torch.distributed as dist

from tests.launcher import REPO_ROOT
from vapo_megatron.config.recipe import load_recipe
from vapo_megatron.data.tokenizer_match import tokenizer_differences
from vapo_megatron.tiny.reward_model import ensure_tiny_critic
from vapo_megatron.weights.hf_io import HFCheckpoint

pytestmark = pytest.mark.unit
RECIPE = REPO_ROOT / "recipes" / "tiny_cpu_small_critic.yaml"
POLICY = REPO_ROOT / "vapo_megatron" / "tiny" / "demo" / "model"


def test_written_once_with_the_policys_tokenizer_and_half_its_width(tmp_path):
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    host = dist.new_group(backend="gloo")
    out = tmp_path / "critic"
    config = load_recipe(RECIPE, [f"model.path={POLICY}", f"critic.model={out}"])
    ensure_tiny_critic(config, host)
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["Qwen2ForSequenceClassification"]
    assert (written["num_hidden_layers"], written["hidden_size"], len(written["id2label"])) == (
        1,
        64,
        1,
    )
    assert tokenizer_differences(POLICY, out) == []
    first = dict(HFCheckpoint(out).read(HFCheckpoint(out).names))
    assert first["score.weight"].shape == (1, 64) and first["score.weight"].any()
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    ensure_tiny_critic(config, host)  # there already: left as it is
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    again = tmp_path / "again"
    ensure_tiny_critic(load_recipe(RECIPE, [f"model.path={POLICY}", f"critic.model={again}"]), host)
    second = dict(HFCheckpoint(again).read(HFCheckpoint(again).names))
    assert all(torch.equal(second[k], v) for k, v in first.items())  # seeded
