"""Qwen3 and Qwen3-MoE through the converter: HF -> Megatron at TP x PP x EP (x expert TP)
-> HF, bit-identical tensors and the same config.json.

Tiny random models written by transformers (its per-expert file names); the conversions run
in one 4-rank gloo launch and the exports in one 1-rank launch, as ``test_convert.py`` does
for Qwen2. The command line with ``--ep`` is the slow test at the end.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration.weights.test_convert import hf_config, hf_tensors, last_json, run_convert
from tests.launcher import run_workers

pytestmark = pytest.mark.integration

WORKER = Path(__file__).parent / "workers" / "convert_worker.py"
# name -> (model, tp, pp, ep, etp); 4 ranks each (DP / expert DP take the rest).
CONVERSIONS = {
    "qwen3-tp2pp2": ("qwen3", 2, 2, 1, None),
    "moe-tp2ep2": ("qwen3_moe", 2, 1, 2, None),  # expert TP = TP = 2: 4 ranks of experts
    "moe-tp2ep2etp1": ("qwen3_moe", 2, 1, 2, 1),
    "moe-pp2ep2": ("qwen3_moe", 1, 2, 2, None),
}


def make_qwen3(out: Path, *, moe: bool, seed: int) -> None:
    """A random Qwen3 (tied) or Qwen3-MoE (untied; 4 experts, top 2) of 2 layers, hidden 64,
    4 heads of head_dim 8 (query width 32 against hidden 64), weights large enough that every
    mapping error changes a tensor."""
    import transformers

    common = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=300, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
        tie_word_embeddings=not moe,
    )  # fmt: skip
    if moe:
        config = transformers.Qwen3MoeConfig(
            moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
            **common,
        )  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            scale = 0.2 if name.endswith("norm.weight") else param.shape[-1] ** -0.5
            param.copy_(noise * scale + (1.0 if name.endswith("norm.weight") else 0.0))
    model.save_pretrained(out)
    (out / "tokenizer_config.json").write_text('{"model_max_length": 64}')


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    make_qwen3(root / "qwen3", moe=False, seed=0)
    make_qwen3(root / "qwen3_moe", moe=True, seed=1)
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


def assert_same_model(back: Path, original: Path) -> None:
    want, got = hf_tensors(original), hf_tensors(back)
    assert got.keys() == want.keys()
    unequal = [key for key, tensor in want.items() if not torch.equal(got[key], tensor)]
    assert unequal == []
    assert hf_config(back) == hf_config(original)
    assert (back / "tokenizer_config.json").read_text() == '{"model_max_length": 64}'


@pytest.mark.parametrize("name", CONVERSIONS)
def test_round_trip_is_bit_identical(name: str, hf_models: Path, converted: Path) -> None:
    assert_same_model(converted / "back" / name, hf_models / CONVERSIONS[name][0])


def test_moe_checkpoint_records_its_expert_layout(converted: Path) -> None:
    from vapo_megatron.checkpoint import model as ckpt

    meta = ckpt.load_metadata(converted / "mcore" / "moe-tp2ep2etp1")
    assert (meta.architecture, meta.tp, meta.pp) == ("Qwen3MoeForCausalLM", 2, 1)
    assert (meta.origin["ep"], meta.origin["etp"]) == (2, 1)


@pytest.mark.slow
def test_cli_hf_to_mcore_with_ep_and_back(hf_models: Path, tmp_path: Path) -> None:
    """``--tp 2 --ep 2`` (4 ranks the tool starts itself: expert TP 2 x EP 2), ``verify`` of
    that checkpoint against transformers' logits, then ``mcore-to-hf``; a layout EP does not
    divide is refused before any rank starts."""
    hf, out, back = hf_models / "qwen3_moe", tmp_path / "mcore", tmp_path / "back"
    refused = run_convert("hf-to-mcore", "--hf", str(hf), "--out", str(out), "--ep", "3")
    assert refused.returncode == 2 and "ep=3 must divide num_experts=4" in refused.stderr
    saved = run_convert(
        "hf-to-mcore", "--hf", str(hf), "--out", str(out), "--tp", "2", "--ep", "2", timeout=600
    )
    assert saved.returncode == 0, saved.stderr[-3000:]
    summary = last_json(saved.stdout)
    assert (summary["ranks"], summary["ep"], summary["etp"]) == (4, 2, 2)
    verified = run_convert("verify", "--hf", str(hf), "--ckpt", str(out), timeout=600)
    assert verified.returncode == 0, verified.stderr[-3000:]
    report = last_json(verified.stdout)  # loaded at TP 1, EP 1: megatron's MoE = transformers'
    assert report["passed"] and report["next_token_agreement"] == 1.0
    assert report["max_abs_diff"] < 1e-4
    exported = run_convert("mcore-to-hf", "--ckpt", str(out), "--out", str(back))
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert_same_model(back, hf)
