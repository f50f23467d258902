"""tools/demo.py and tools/ablate.py end to end: a shortened demo writes every output, shows a
finished run again and resumes a longer one; a two-preset sweep prints its table and skips
finished runs; the full demo (slow) gains 15 points of held-out pass rate, and the shipped
warmed-up model (slow) is what tools/make_tiny.py rebuilds."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launcher import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.distributed]

DEMO = REPO_ROOT / "tools" / "demo.py"
ABLATE = REPO_ROOT / "tools" / "ablate.py"
RECIPE = REPO_ROOT / "recipes" / "demo.yaml"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def asset_overrides(root: Path) -> list[str]:
    """The demo's assets under ``root`` (the full-size task and warm-up); the converted policy
    goes to root/policy_mcore (policy.load, once the recipe loads it)."""
    return [
        f"model.path={root}/model", f"data.train_path={root}/train.jsonl",
        f"data.eval_path={root}/eval.jsonl", f"policy.load={root}/policy_mcore",
    ]  # fmt: skip


def short_overrides(root: Path) -> list[str]:
    """A demo of minutes: a small task, a short warm-up, 2 steps, a few eval prompts."""
    return [
        *asset_overrides(root),
        "model.tiny_warmup_steps=40", "model.tiny_num_train=200", "model.tiny_num_eval=16",
        "algorithm.value_pretrain_steps=1", "critic_pretrain.min_steps=1",
        "algorithm.prompts_per_step=4", "algorithm.samples_per_prompt=4",
        "trainer.mini_batch_size=8", "trainer.steps=2", "trainer.checkpoint_every=1",
        "rollout.max_new_tokens=48", "eval.k=2", "eval.every=0", "eval.max_prompts=8",
        "trainer.progress_bar=false",
    ]  # fmt: skip


def run_tool(tool: Path, *args: str, timeout: float = 480) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run(
        [sys.executable, str(tool), *args], env=env, capture_output=True, text=True,
        timeout=timeout, cwd=REPO_ROOT,
    )  # fmt: skip
    assert done.returncode == 0, (
        f"{tool.name} exit {done.returncode}\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
    )
    return done.stdout


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """The short demo's assets and converted policy, built once for this module's tests."""
    spec = importlib.util.spec_from_file_location("demo", DEMO)
    demo = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(DEMO.parent))
    spec.loader.exec_module(demo)
    from vapo_megatron.config.recipe import load_recipe

    root = tmp_path_factory.mktemp("demo_assets")
    built = demo.prepare_assets(load_recipe(RECIPE, short_overrides(root)), log=lambda _: None)
    assert built["assets_seconds"] > 0 and built["convert_seconds"] > 0
    assert (root / "policy_mcore" / "vapo_checkpoint.json").is_file()
    return root


def check_outputs(run_dir: Path, stdout: str, steps: int) -> dict:
    """Every output file exists and is well formed; the console names them last."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    phases = {(row["phase"], row["step"]) for row in rows}
    assert {("eval", 0), ("eval", steps), ("critic_pretrain", 1)} <= phases
    assert {("train", s) for s in range(1, steps + 1)} <= phases
    events = list((run_dir / "tensorboard").glob("events.*"))
    assert events and all(e.stat().st_size > 0 for e in events)
    png = (run_dir / "curves.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 10_000
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("pass_rate_before", "pass_rate_after"):
        assert 0.0 <= summary[key] <= 1.0
        assert summary[f"{key}_stderr"] >= 0.0
    assert summary["steps"] == steps and summary["seconds"] > 0
    assert (run_dir / "hf_policy" / "config.json").is_file()
    listed = stdout.strip().splitlines()[-(len(events) + 5) :]
    assert listed[0] == "demo: outputs", stdout[-2000:]
    for path in (
        run_dir / "metrics.jsonl",
        *events,
        run_dir / "curves.png",
        run_dir / "summary.json",
    ):
        assert f"  {path}" in listed
    return summary


def test_short_demo_writes_outputs_shows_and_resumes(assets, tmp_path):
    run_dir = tmp_path / "demo"
    args = [*short_overrides(assets), f"trainer.run_dir={run_dir}"]
    out = run_tool(DEMO, *args)
    assert "demo: starting fresh" in out and "assets reused" in out
    first = check_outputs(run_dir, out, steps=2)
    assert first["start"] == "fresh" and first["resumed"] is False
    # A finished run is shown again, nothing retrained.
    again = run_tool(DEMO, *args, timeout=120)
    assert "holds a finished run" in again
    assert json.loads((run_dir / "summary.json").read_text()) == first
    # More steps over the same directory: resumes from the step-2 checkpoint.
    more = run_tool(DEMO, *args, "trainer.steps=3")
    assert "demo: resuming" in more
    resumed = check_outputs(run_dir, more, steps=3)
    assert resumed["start"] == "resumed" and resumed["resumed"] is True


@pytest.mark.slow  # CI time (~105s on 2 busy cores); the demo test above runs the same trainer path
def test_ablate_two_presets_one_seed(assets, tmp_path):
    out_dir = tmp_path / "ablate"
    args = ["--only", "vapo,grpo", "--seeds", "1", "--steps", "2", "--out", str(out_dir),
            *short_overrides(assets)]  # fmt: skip
    out = run_tool(ABLATE, *args)
    lines = out.splitlines()
    assert any(line.startswith("| VAPO | `vapo` |") for line in lines), out
    assert any(line.startswith("| GRPO | `grpo` |") for line in lines), out
    results = json.loads((out_dir / "table.json").read_text())
    assert set(results) == {"vapo", "grpo"}
    for name, runs in results.items():
        assert len(runs) == 1 and runs[0]["steps"] == 2, name
        assert 0.0 <= runs[0]["pass_rate_after"] <= 1.0
    vapo_config = (out_dir / "vapo" / "seed_1" / "config.yaml").read_text()
    assert "critic_init: policy" in vapo_config
    assert results["grpo"][0]["critic_pretrain_steps"] == 0
    # Resumable: finished runs are skipped, the table comes back unchanged.
    again = run_tool(ABLATE, *args, timeout=120)
    assert again.count("done, skipped") == 2
    assert json.loads((out_dir / "table.json").read_text()) == results


EXACT_MODEL_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
)  # fmt: skip
PASS_RATE_Z = 3.0
"""How many standard errors a rebuilt model's pass rate may lie from the recorded one."""


def binomial_z(rebuilt: float, recorded: float, prompts: int) -> float:
    """|rebuilt - recorded| in standard errors of the difference of two pass rates over
    ``prompts`` prompts each: sqrt(2 p (1 - p) / prompts), p their mean. Both rates come from
    the same prompts, whose shared difficulty makes the true spread smaller: the bound is
    conservative."""
    if rebuilt == recorded:
        return 0.0
    p = (rebuilt + recorded) / 2
    return abs(rebuilt - recorded) / math.sqrt(2 * p * (1 - p) / prompts)


@pytest.mark.slow  # ~12 CPU minutes: the 8000-step warm-up on one thread
@pytest.mark.timeout(3700)  # past run_tool's 3600 s (pytest.ini's 600 s is shorter than the build)
def test_shipped_model_regenerates(tmp_path):
    """tools/make_tiny.py with the shipped model's recorded values writes the same task and
    tokenizer bytes and a model that behaves as the shipped one.

    The model's bytes are the same only on the CPU that made it: float sums are reduced in a
    different order on another CPU, and 8000 warm-up steps carry the rounding differences into
    every weight (seen: another CPU's rebuild passed 0.04 greedy and 0.19 at T=1 against the
    stamp's 0.045 and 0.18). Its behaviour is held instead: each pass rate over the stamp's 200
    eval prompts within PASS_RATE_Z = 3 standard errors of the recorded one; the standard error
    of the difference, sqrt(2 p (1 - p) / 200), is 0.021 at greedy's p = 0.045 and 0.038 at
    T=1's p = 0.18, so greedy may read 0.0 to 0.11 and T=1 0.07 to 0.30; a model that never
    answers (0 at T=1) is 6 standard errors off."""
    shipped = REPO_ROOT / "vapo_megatron" / "tiny" / "demo"
    stamp = json.loads((shipped / "stamp.json").read_text())
    values = stamp["params"]
    out = run_tool(
        REPO_ROOT / "tools" / "make_tiny.py", str(tmp_path / "tiny"),
        "--seed", str(values["seed"]), "--warmup-steps", str(values["warmup_steps"]),
        "--slip-rate", str(values["slip_rate"]), "--guess-rate", str(values["guess_rate"]),
        "--n-train", str(values["n_train"]), "--n-eval", str(values["n_eval"]),
        "--template", values["template"], timeout=3600,
    )  # fmt: skip
    result = json.loads(out.strip().splitlines()[-1])
    # Exact: the task, the tokenizer and the model's configuration involve no float arithmetic.
    assert result["train_sha256"] == stamp["result"]["train_sha256"]
    for name in EXACT_MODEL_FILES:
        rebuilt = (tmp_path / "tiny" / "model" / name).read_bytes()
        assert rebuilt == (shipped / "model" / name).read_bytes(), name
    from safetensors import safe_open

    with safe_open(shipped / "model" / "model.safetensors", "pt") as old, safe_open(
        tmp_path / "tiny" / "model" / "model.safetensors", "pt"
    ) as new:  # fmt: skip
        assert sorted(new.keys()) == sorted(old.keys())
        for key in old.keys():
            a, b = old.get_slice(key), new.get_slice(key)
            assert (a.get_shape(), a.get_dtype()) == (b.get_shape(), b.get_dtype()), key
    # The weights: by behaviour.
    prompts = values["eval_prompts"]
    for rate in ("pass_rate_greedy", "pass_rate_t1"):
        z = binomial_z(result[rate], stamp["result"][rate], prompts)
        assert z <= PASS_RATE_Z, (rate, result[rate], stamp["result"][rate], z)


@pytest.mark.slow
@pytest.mark.timeout(1900)  # past run_tool's 1800 s (pytest.ini's 600 s is shorter than the demo)
def test_full_demo_gains_15_points(tmp_path):
    run_dir = tmp_path / "demo"
    out = run_tool(
        DEMO, "--fresh", *asset_overrides(tmp_path / "assets"), f"trainer.run_dir={run_dir}",
        timeout=1800,
    )  # fmt: skip
    summary = check_outputs(
        run_dir, out, steps=json.loads((run_dir / "summary.json").read_text())["steps"]
    )
    assert 0.0 < summary["pass_rate_before"] < 0.3, summary
    assert summary["pass_rate_after"] - summary["pass_rate_before"] >= 0.15, summary
