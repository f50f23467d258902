"""tools/convert.py and checkpoint/model.py: HF -> Megatron -> HF round trips, resharding on
load, critics, verify, and every bad input with its message.

Tiny random Qwen2 models in several shapes (tied/untied, GQA ratios 1 and 4, vocabularies that
128 * TP does not divide, fp32 and bf16) are converted at TP x PP in {1, 2}^2 by real gloo
processes (one 4-rank launch for all conversions and cross-layout loads, one 1-rank launch for
all exports); the tests compare the files that come back with the originals.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.launcher import REPO_ROOT, run_workers
from vapo_megatron.checkpoint import model as ckpt
from vapo_megatron.weights.hf_io import HFCheckpoint

pytestmark = pytest.mark.integration

WORKER = Path(__file__).parent / "workers" / "convert_worker.py"
CONVERT = REPO_ROOT / "tools" / "convert.py"
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
# name -> (config overrides, dtype on disk, --dtype of the conversion)
POLICIES = {
    "gqa4-untied-fp32": (
        {"num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 300},
        "fp32",
        None,
    ),
    "gqa1-tied-bf16": (
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "tie_word_embeddings": True,
            "vocab_size": 250,
        },
        "bf16",
        None,
    ),
    "gqa1-untied-fp32-as-bf16": (
        {"num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1000},
        "fp32",
        "bf16",
    ),
}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_hf_model(
    out: Path, overrides: dict, dtype: str, *, reward_model: bool = False, seed: int = 0
) -> None:
    """A random Qwen2 model (2 layers, hidden 64) saved by transformers, weights large enough
    that every mapping error moves the logits."""
    import transformers

    heads = overrides.get("num_attention_heads", 4)
    config = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        head_dim=64 // heads,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
        num_labels=1,
        **overrides,
    )
    cls = (
        transformers.Qwen2ForSequenceClassification
        if reward_model
        else transformers.Qwen2ForCausalLM
    )
    model = cls(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * noise)
            elif param.dim() == 1:
                param.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:
                param.copy_(noise / param.shape[1] ** 0.5)
    model.to(TORCH_DTYPES[dtype]).save_pretrained(out)
    (out / "tokenizer_config.json").write_text('{"model_max_length": 64}')


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    checkpoint = HFCheckpoint(path)
    return dict(checkpoint.read(checkpoint.names))


def hf_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def corrupt_qk(src: Path, dst: Path) -> None:
    """Copy an HF model with layer 0's first query head and first key head swapped."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    q, k = (tensors[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qk")
    rows = k.shape[0] // 2  # head_dim (2 KV heads)
    q_head = q[:rows].clone()
    q[:rows] = k[:rows]
    k[:rows] = q_head
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def run_convert(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CONVERT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    for seed, (name, (overrides, dtype, _)) in enumerate(POLICIES.items()):
        make_hf_model(root / name, overrides, dtype, seed=seed)
    reward = {"num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 300}
    make_hf_model(root / "reward", reward, "bf16", reward_model=True, seed=7)
    corrupt_qk(root / "gqa4-untied-fp32", root / "gqa4-corrupted")
    return root


@pytest.fixture(scope="module")
def converted(hf_models: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every conversion, cross-layout load and export; what each rank measured."""
    root = tmp_path_factory.mktemp("converted")
    conversions, exports = [], []

    def add(hf: str, name: str, tp: int, pp: int, **extra) -> str:
        out = str(root / "mcore" / name)
        conversions.append({"hf": str(hf_models / hf), "out": out, "tp": tp, "pp": pp, **extra})
        exports.append({"ckpt": out, "out": str(root / "back" / name)})
        return out

    for name, (_, _, dtype) in POLICIES.items():
        for tp, pp in LAYOUTS:
            add(name, f"{name}/tp{tp}pp{pp}", tp, pp, dtype=dtype)
    add("gqa4-untied-fp32", "critic-from-policy", 2, 2, critic_from="policy")
    add("reward", "critic-from-reward/tp2pp1", 2, 1, critic_from="reward-model")
    add("reward", "critic-from-reward/tp1pp2", 1, 2, critic_from="reward-model")
    add("gqa4-corrupted", "corrupted", 1, 1)
    exports[0]["max_shard_bytes"] = 20_000  # several shards and an index

    def load(hf: str, name: str, tp: int, pp: int, **extra) -> dict:
        return {
            "ckpt": str(root / "mcore" / name),
            "hf": str(hf_models / hf),
            "tp": tp,
            "pp": pp,
            **extra,
        }

    loads = [
        load("gqa4-untied-fp32", "gqa4-untied-fp32/tp2pp2", 1, 1),  # padded vocab 512 -> 384
        load("gqa4-untied-fp32", "gqa4-untied-fp32/tp1pp1", 2, 2),  # 384 -> 512
        load("gqa1-tied-bf16", "gqa1-tied-bf16/tp1pp2", 2, 1),
        load("gqa1-tied-bf16", "gqa1-tied-bf16/tp2pp1", 1, 2),
        load(
            "gqa1-untied-fp32-as-bf16", "gqa1-untied-fp32-as-bf16/tp2pp2", 1, 1, params_dtype="fp32"
        ),
        load(
            "gqa4-untied-fp32",
            "gqa4-untied-fp32/tp2pp2",
            2,
            1,
            params_dtype="bf16",
            float16_module=True,
        ),
        load("gqa4-untied-fp32", "critic-from-policy", 1, 2),
        load("reward", "critic-from-reward/tp2pp1", 1, 2),
        load("gqa4-untied-fp32", "gqa4-untied-fp32/tp1pp1", 1, 1, head="value"),
        load("reward", "critic-from-reward/tp1pp2", 2, 1, head="lm"),
    ]
    save_plan = root / "save.json"
    save_plan.write_text(json.dumps({"out": str(root), "conversions": conversions, "loads": loads}))
    run_workers(WORKER, 4, str(save_plan), timeout=300)
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(4)]
    export_plan = root / "export.json"
    (root / "exports").mkdir()
    export_plan.write_text(json.dumps({"out": str(root / "exports"), "exports": exports}))
    run_workers(WORKER, 1, str(export_plan), timeout=300)
    return {"root": root, "loads": loads, "ranks": ranks}


# ----- round trips -----


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: f"tp{layout[0]}pp{layout[1]}")
@pytest.mark.parametrize("name", POLICIES)
def test_round_trip_is_bit_identical(
    name: str, layout: tuple[int, int], hf_models: Path, converted: dict
) -> None:
    _, disk_dtype, dtype = POLICIES[name]
    back = converted["root"] / "back" / name / f"tp{layout[0]}pp{layout[1]}"
    original, returned = hf_tensors(hf_models / name), hf_tensors(back)
    assert returned.keys() == original.keys()
    want_dtype = TORCH_DTYPES[dtype or disk_dtype]
    for key, tensor in original.items():
        assert returned[key].dtype == want_dtype, key
        assert torch.equal(returned[key], tensor.to(want_dtype)), key
    config, original_config = hf_config(back), hf_config(hf_models / name)
    if dtype is not None:  # the cast is recorded in the config, nothing else changes
        assert config.pop("dtype") == "bfloat16" and original_config.pop("dtype") == "float32"
    assert config == original_config
    assert (back / "tokenizer_config.json").read_text() == '{"model_max_length": 64}'


def test_metadata_records_what_the_trainer_checks(hf_models: Path, converted: dict) -> None:
    ckpt_dir = converted["root"] / "mcore" / "gqa4-untied-fp32" / "tp2pp2"
    meta = ckpt.load_metadata(ckpt_dir)
    assert (meta.architecture, meta.head, meta.tp, meta.pp, meta.dtype) == (
        "Qwen2ForCausalLM",
        "lm",
        2,
        2,
        "float32",
    )
    assert (meta.vocab_size, meta.padded_vocab_size, meta.make_vocab_size_divisible_by) == (
        300,
        512,
        128,
    )
    assert meta.hf_config == hf_config(hf_models / "gqa4-untied-fp32")
    assert meta.origin["source"] == str((hf_models / "gqa4-untied-fp32").resolve())
    assert meta.megatron_core_version == "0.16.1"
    assert (ckpt_dir / ckpt.ASSETS_DIR / "tokenizer_config.json").is_file()


def test_sharded_export_has_an_index_and_loads_in_transformers(
    hf_models: Path, converted: dict
) -> None:
    import transformers

    back = converted["root"] / "back" / "gqa4-untied-fp32" / "tp1pp1"
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(hf_models / "gqa4-untied-fp32")(
            tokens
        ).logits
        got = transformers.AutoModelForCausalLM.from_pretrained(back)(tokens).logits
    assert torch.equal(got, want)


# ----- loading at another layout than saved -----


def test_loads_at_other_layouts_give_the_record_shards(converted: dict) -> None:
    for i, job in enumerate(converted["loads"]):
        if "head" in job:
            continue
        for rank, result in enumerate(converted["ranks"]):
            got = result["loads"][i]
            assert got.get("compared", 0) > 0 and got["unequal"] == [], (job, rank, got)


def test_head_mismatch_is_refused_with_the_way_out(converted: dict) -> None:
    errors = {
        job["head"]: result["loads"][i].get("error", "")
        for i, job in enumerate(converted["loads"])
        if "head" in job
        for result in converted["ranks"]
    }
    assert (
        "this is a policy checkpoint" in errors["value"]
        and "--critic-from policy" in errors["value"]
    )
    assert "this is a critic checkpoint" in errors["lm"] and "head='value'" in errors["lm"]


# ----- critics -----


def test_critic_from_policy_has_the_policy_trunk_and_a_zero_value_head(
    hf_models: Path, converted: dict
) -> None:
    back = converted["root"] / "back" / "critic-from-policy"
    policy, critic = hf_tensors(hf_models / "gqa4-untied-fp32"), hf_tensors(back)
    assert critic.keys() == (policy.keys() - {"lm_head.weight"}) | {"score.weight"}
    for key, tensor in critic.items():
        if key != "score.weight":
            assert torch.equal(tensor, policy[key]), key
    assert critic["score.weight"].shape == (1, 64) and not critic["score.weight"].any()
    config = hf_config(back)
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
    assert config["id2label"] == {"0": "LABEL_0"}
    assert (
        ckpt.load_metadata(converted["root"] / "mcore" / "critic-from-policy").origin["critic_from"]
        == "policy"
    )


@pytest.mark.parametrize("layout", ["tp2pp1", "tp1pp2"])
def test_critic_from_reward_model_round_trips(
    layout: str, hf_models: Path, converted: dict
) -> None:
    back = converted["root"] / "back" / "critic-from-reward" / layout
    reward, critic = hf_tensors(hf_models / "reward"), hf_tensors(back)
    assert critic.keys() == reward.keys() and critic["score.weight"].shape == (1, 64)
    assert all(torch.equal(critic[key], tensor) for key, tensor in reward.items())
    assert hf_config(back) == hf_config(hf_models / "reward")


# ----- the command line -----


def test_cli_convert_verify_export(hf_models: Path, tmp_path: Path) -> None:
    """Saved by 2 ranks the tool starts itself, verified at another layout, exported back."""
    out = tmp_path / "mcore"
    out.mkdir()
    (out / "stale").write_text("replaced under --force")
    hf = hf_models / "gqa1-tied-bf16"
    saved = run_convert("hf-to-mcore", "--hf", str(hf), "--out", str(out), "--tp", "2", "--force")
    assert saved.returncode == 0, saved.stderr[-3000:]
    summary = last_json(saved.stdout)
    assert (summary["ranks"], summary["padded_vocab_size"], summary["dtype"]) == (
        2,
        256,
        "bfloat16",
    )
    assert not (out / "stale").exists()

    verified = run_convert("verify", "--hf", str(hf), "--ckpt", str(out), "--pp", "2")
    assert verified.returncode == 0, verified.stderr[-3000:]
    report = last_json(verified.stdout)
    assert report["passed"] and report["next_token_agreement"] == 1.0
    assert report["max_abs_diff"] < 1e-4 and report["tolerance"]["precision"] == "exact"

    back = tmp_path / "back"
    exported = run_convert("mcore-to-hf", "--ckpt", str(out), "--out", str(back))
    assert exported.returncode == 0, exported.stderr[-3000:]
    original = hf_tensors(hf)
    assert all(torch.equal(hf_tensors(back)[k], t) for k, t in original.items())


def test_cli_verify_fails_on_a_corrupted_checkpoint(hf_models: Path, converted: dict) -> None:
    corrupted = converted["root"] / "mcore" / "corrupted"
    result = run_convert(
        "verify", "--hf", str(hf_models / "gqa4-untied-fp32"), "--ckpt", str(corrupted)
    )
    assert result.returncode == 1, result.stderr[-3000:]
    report = last_json(result.stdout)
    assert (
        not report["passed"] and report["max_abs_diff"] > 100 * report["tolerance"]["max_abs_diff"]
    )


@pytest.mark.slow
def test_cli_critic_at_tp2_pp2_verifies_against_the_reward_model(
    hf_models: Path, tmp_path: Path
) -> None:
    """4 ranks started by the tool; the critic's values equal transformers' per-token scores."""
    out = tmp_path / "critic"
    hf = hf_models / "reward"
    args = ["--hf", str(hf), "--out", str(out), "--tp", "2", "--pp", "2"]
    saved = run_convert("hf-to-mcore", *args, "--critic-from", "reward-model")
    assert saved.returncode == 0, saved.stderr[-3000:]
    assert last_json(saved.stdout)["ranks"] == 4
    verified = run_convert("verify", "--hf", str(hf), "--ckpt", str(out), "--tp", "2")
    assert verified.returncode == 0, verified.stderr[-3000:]
    report = last_json(verified.stdout)
    assert report["passed"] and report["next_token_agreement"] is None
    assert report["max_abs_diff"] < 1e-4


@pytest.mark.slow
def test_bench_quick() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "bench.py"), "convert", "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)
    assert summary["bench"] == "convert" and summary["gbps"] > 0
    assert 0 < summary["fraction_of_copy"]


# ----- bad input -----


@pytest.fixture(scope="module")
def convert_main():
    spec = importlib.util.spec_from_file_location("convert_tool", CONVERT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def damaged_copy(hf_models: Path, tmp_path: Path, damage: str) -> Path:
    src = hf_models / "gqa4-untied-fp32"
    dst = tmp_path / damage
    shutil.copytree(src, dst)
    config = hf_config(dst)
    tensors = load_file(dst / "model.safetensors")
    if damage == "unknown-architecture":
        config.update(model_type="mistral", architectures=["MistralForCausalLM"])
    elif damage == "missing-tensor":
        del tensors["model.layers.1.mlp.down_proj.weight"]
    elif damage == "unexpected-tensor":
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
    elif damage == "shape-mismatch":
        config["intermediate_size"] = 128
    (dst / "config.json").write_text(json.dumps(config))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.unit
@pytest.mark.parametrize(
    "damage, message",
    [
        ("unknown-architecture", "model_type 'mistral' is not supported"),
        ("missing-tensor", "missing: ['model.layers.1.mlp.down_proj.weight']"),
        ("unexpected-tensor", "unexpected tensor(s)"),
        ("shape-mismatch", "has shape (64, 96), the config implies (64, 128)"),
    ],
)
def test_bad_hf_checkpoints_are_refused(
    damage, message, hf_models, tmp_path, convert_main, capsys
) -> None:
    hf = damaged_copy(hf_models, tmp_path, damage)
    assert convert_main(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.parametrize(
    "model, extra, message",
    [
        ("gqa4-untied-fp32", ["--tp", "16"], "tp=16 must divide num_attention_heads=8"),
        ("gqa4-untied-fp32", ["--pp", "3"], "must divide num_layers=2"),
        ("gqa1-tied-bf16", ["--tp", "3"], "tp=3 must divide num_attention_heads=4"),
        ("reward", [], "--critic-from reward-model"),
        ("reward", ["--critic-from", "policy"], "not a policy"),
        ("gqa4-untied-fp32", ["--critic-from", "reward-model"], "--critic-from policy"),
    ],
)
def test_bad_requests_are_refused(
    model, extra, message, hf_models, tmp_path, convert_main, capsys
) -> None:
    args = ["hf-to-mcore", "--hf", str(hf_models / model), "--out", str(tmp_path / "out"), *extra]
    assert convert_main(args) == 2
    assert message in capsys.readouterr().err


@pytest.mark.unit
def test_output_dir_must_be_empty_unless_forced(hf_models, tmp_path, convert_main, capsys) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("")
    args = [
        "hf-to-mcore",
        "--hf",
        str(hf_models / "gqa4-untied-fp32"),
        "--out",
        str(tmp_path / "out"),
    ]
    assert convert_main(args) == 2
    assert "is not empty; pass --force" in capsys.readouterr().err
    inside = ["--out", str(hf_models / "gqa4-untied-fp32"), "--force"]
    assert convert_main([*args[:3], *inside]) == 2
    assert "would overwrite the input" in capsys.readouterr().err
    not_a_ckpt = ["mcore-to-hf", "--ckpt", str(hf_models / "reward"), "--out", str(tmp_path / "x")]
    assert convert_main(not_a_ckpt) == 2
    assert "looks like a Hugging Face model" in capsys.readouterr().err
