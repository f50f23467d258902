"""DeepSeek-V3 (MLA, YaRN) and GLM-4.5 through the converter: HF -> Megatron at TP x PP x EP
(x expert TP) -> HF, bit-identical tensors (the expert-score bias included, though megatron
holds it as a buffer) and the same config.json.

Tiny random models written by transformers (4 layers, the first dense; 8 experts in 4 groups,
a shared expert; DeepSeek-V3 with one multi-token-prediction layer, carried frozen beside the
model); the conversions run in one 4-rank gloo launch and the exports in one 1-rank launch, as
``test_convert_qwen3.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration.weights.test_convert_qwen3 import WORKER, assert_same_model
from tests.launcher import run_workers

pytestmark = pytest.mark.integration

# name -> (model, tp, pp, ep, etp); 4 ranks each. TP 2 x PP 2 x EP 2 with expert TP 1: MLA's
# column-split projections, the dense layer and the MoE layer on one stage, experts split.
CONVERSIONS = {
    "dsv3-tp2pp2ep2etp1": ("deepseek_v3", 2, 2, 2, 1),
    "glm-tp2pp2ep2etp1": ("glm4_moe", 2, 2, 2, 1),
}


def make_model(out: Path, family: str, *, seed: int) -> None:
    """A random tiny model of ``family`` (``tiny/model.py``'s config, 4 layers; DeepSeek-V3
    with YaRN), weights and expert biases large enough that every mapping error changes a
    tensor."""
    import transformers

    from vapo_megatron.tiny.model import (
        tiny_deepseek_v3_config,
        tiny_glm4_moe_config,
        train_tokenizer,
    )

    tokenizer = train_tokenizer(["12+34=46", "Answer: 46"], vocab_size=300)
    if family == "deepseek_v3":
        config = tiny_deepseek_v3_config(tokenizer, num_layers=4, yarn=True)
    else:
        config = tiny_glm4_moe_config(tokenizer, num_layers=4)
    model = transformers.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            norm = name.endswith("norm.weight")
            scale = 0.2 if norm or param.dim() == 1 else param.shape[-1] ** -0.5
            param.copy_(noise * scale + (1.0 if norm else 0.0))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.1)
    model.save_pretrained(out)
    (out / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    if family == "deepseek_v3":
        add_mtp_layer(out, gen)


def add_mtp_layer(out: Path, gen: torch.Generator) -> None:
    """One multi-token-prediction layer (transformers builds none): a few of its tensors under
    DeepSeek-V3's names, ``num_nextn_predict_layers`` 1 in config.json."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(out / "model.safetensors")
    for name, shape in (
        ("enorm.weight", (64,)), ("hnorm.weight", (64,)), ("eh_proj.weight", (64, 128)),
        ("shared_head.norm.weight", (64,)), ("self_attn.q_a_proj.weight", (32, 64)),
        ("mlp.gate.e_score_correction_bias", (8,)),
    ):  # fmt: skip
        tensors[f"model.layers.4.{name}"] = torch.randn(shape, generator=gen)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=1)))


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    make_model(root / "deepseek_v3", "deepseek_v3", seed=0)
    make_model(root / "glm4_moe", "glm4_moe", seed=1)
    return root


@pytest.fixture(scope="module")
def converted(hf_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("converted")
    conversions, exports = [], []
    for name, (model, tp, pp, ep, etp) in CONVERSIONS.items():
        out = str(root / "mcore" / name)
        job = {"hf": str(hf_models / model), "out": out, "tp": tp, "pp": pp, "ep": ep}
        conversions.append({**job, "etp": etp})
        exports.append({"ckpt": out, "out": str(root / "back" / name)})
    plan = root / "save.json"
    plan.write_text(json.dumps({"out": str(root), "conversions": conversions}))
    run_workers(WORKER, 4, str(plan), timeout=600)
    plan = root / "export.json"
    (root / "exports").mkdir()
    plan.write_text(json.dumps({"out": str(root / "exports"), "exports": exports}))
    run_workers(WORKER, 1, str(plan), timeout=600)
    return root


@pytest.mark.parametrize("name", CONVERSIONS)
def test_round_trip_is_bit_identical(name: str, hf_models: Path, converted: Path) -> None:
    assert_same_model(converted / "back" / name, hf_models / CONVERSIONS[name][0])


def test_the_expert_bias_and_the_mtp_layer_survive(hf_models: Path, converted: Path) -> None:
    from tests.integration.weights.test_convert import hf_tensors

    back = hf_tensors(converted / "back" / "dsv3-tp2pp2ep2etp1")
    bias = back["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().min() > 0
    assert sum(name.startswith("model.layers.4.") for name in back) == 6  # weights/mtp.py
    assert (converted / "mcore" / "dsv3-tp2pp2ep2etp1" / "mtp" / "config.json").is_file()
