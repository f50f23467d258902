"""The sbatch scripts: dry runs for both, and the real launch path through a fake ``srun``.

The fake ``srun``/``scontrol`` (tests/integration/fake_bin/) start the command as local tasks
with Slurm's task variables, so the line from the sbatch script through the rank wrapper to
``vapo-train`` runs here with the tiny CPU recipe (2 gloo ranks, one step).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.integration.trainer_runs import make_assets, read_metrics
from tests.launcher import REPO_ROOT
from vapo_megatron.checkpoint import model as mckpt
from vapo_megatron.launch.local_launch import free_port
from vapo_megatron.weights import hf_io

pytestmark = pytest.mark.integration
SLURM = REPO_ROOT / "slurm"
FAKE_BIN = Path(__file__).parent / "fake_bin"
SCRIPTS = {"vapo_qwen32b.sh": (128, "qwen2.5-32b"), "vapo_qwen7b_1node.sh": (8, "qwen2.5-7b")}
# The tiny run: one RL step, no critic pretraining, no eval or export.
SHORT = ("trainer.steps=1 algorithm.value_pretrain_steps=0 eval.at_end=false "
         "trainer.export_hf=false trainer.tensorboard=false")  # fmt: skip


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "MASTER"))}
    for key in ("WORLD_SIZE", "LOCAL_RANK", "NODES", "RECIPE", "RUN_DIR", "EXTRA_ARGS"):
        env.pop(key, None)
    env.update(PYTHON=sys.executable, PYTHONWARNINGS="ignore", **extra)
    return env


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """Everything a dry run checks, in place: the tiny model (config, tokenizer), its data as
    tools/prepare_data.py writes it, and policy / critic checkpoint directories carrying their
    vapo_checkpoint.json."""
    root = tmp_path_factory.mktemp("inputs")
    assets = make_assets(root / "assets")
    for dataset, key in (("dapo-math-17k", "data.train_path"), ("aime-2024", "data.eval_path")):
        out = root / f"{dataset}.parquet"
        subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "prepare_data.py"), dataset,
                        "--source", assets[key], "--out", str(out)],
                       check=True, capture_output=True, timeout=120)  # fmt: skip
        assets[key] = str(out)
    hf_config = hf_io.read_config(assets["model.path"])
    for name, head in (("policy", "lm"), ("critic", "value")):
        meta = mckpt.make_metadata(hf_config, head=head, tp=8, pp=1, dtype=torch.bfloat16)
        (root / name).mkdir()
        (root / name / mckpt.METADATA_NAME).write_text(json.dumps(dataclasses.asdict(meta)))
    return {"MODEL_PATH": assets["model.path"], "TRAIN_DATA": assets["data.train_path"],
            "EVAL_DATA": assets["data.eval_path"], "POLICY_LOAD": str(root / "policy"),
            "CRITIC_INIT": str(root / "critic")}  # fmt: skip


@pytest.mark.parametrize(
    "script",
    [
        s if s == "vapo_qwen32b.sh" else pytest.param(s, marks=pytest.mark.slow)
        for s in sorted(SCRIPTS)
    ],
)  # the 32B script by default; the others under -m slow (CI time)
def test_dry_run_prints_and_validates(script: str, inputs: dict[str, str]) -> None:
    world, preset = SCRIPTS[script]
    env = clean_env(DRY_RUN="1", **inputs)
    env.pop("GLOO_SOCKET_IFNAME", None)
    if script == "vapo_qwen32b.sh":  # multi-node: the host group's gloo crosses nodes
        env["GLOO_SOCKET_IFNAME"] = "ib0"
        env["GLIBC_TUNABLES"] = "glibc.rtld.nns=2"  # a user's own tunables: kept
    else:
        env.pop("GLIBC_TUNABLES", None)
    done = subprocess.run(["bash", str(SLURM / script)], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert f"= {world} ranks" in out
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in out and "NCCL_IB_TIMEOUT=" in out
    # Passed on (and listed) when set, like NCCL_SOCKET_IFNAME; absent otherwise.
    assert ("GLOO_SOCKET_IFNAME=ib0\n" in out) == (script == "vapo_qwen32b.sh")
    assert "GLOO_SOCKET_IFNAME=\n" not in out
    # Huge pages for malloc's mappings (launch/host_malloc.py), after the user's tunables.
    own = "glibc.rtld.nns=2:" if script == "vapo_qwen32b.sh" else ""
    assert f"GLIBC_TUNABLES={own}glibc.malloc.hugetlb=1\n" in out
    assert "srun --nodes=" in out and "--ntasks-per-node=8" in out
    assert "--cpus-per-task=12" in out  # srun does not inherit it from sbatch (Slurm >= 22.05)
    assert "--container-image=" in out and "-m vapo_megatron.train" in out
    assert f"--model {preset}" in out
    # The inputs: each one found, the data loaded by the trainer's loader with its row counts.
    assert f"ok       model.path={inputs['MODEL_PATH']}: qwen2, " in out
    assert f"ok       data.train_path={inputs['TRAIN_DATA']}: 400 rows, 0 duplicates" in out
    assert "over 2048 tokens, 400 prompts" in out  # tokenized as the trainer does
    assert f"ok       data.eval_path={inputs['EVAL_DATA']}: 40 rows" in out
    assert f"ok       policy.load={inputs['POLICY_LOAD']}: Qwen2ForCausalLM, saved at tp 8" in out
    assert f"ok       critic.init_path={inputs['CRITIC_INIT']}: Qwen2ForSequenceClass" in out
    resharded = "(the recipe's tp 4 pp 1: resharded on load)"  # saved at TP 8, the 7B is TP 4
    assert (resharded in out) == (script == "vapo_qwen7b_1node.sh")
    assert "MISSING" not in out and "BAD" not in out
    summary = last_json(out)
    assert summary["fits"] is True
    policy = summary["layout"]["policy"]
    assert policy["tp"] * policy["pp"] * policy["cp"] * policy["dp"] == world
    assert "rollout_tp" in summary["layout"]
    assert "vLLM TP" in out and "tp" in out
    # The build of rank 0 in one process (vapo-train --dry-run): the real objects' parameters
    # equal the planner's count.
    assert f"== rank 0 of {world}: vLLM replica 0" in out
    assert out.count(" (equal)\n") == 2  # policy and critic


def test_dry_run_names_each_missing_input_with_the_command_that_makes_it(tmp_path) -> None:
    paths = {"MODEL_PATH": tmp_path / "Qwen2.5-32B", "TRAIN_DATA": tmp_path / "dapo.parquet",
             "EVAL_DATA": tmp_path / "aime.parquet", "POLICY_LOAD": tmp_path / "policy-tp8",
             "CRITIC_INIT": tmp_path / "rm-tp8"}  # fmt: skip
    env = clean_env(DRY_RUN="1", REWARD_MODEL_ID="example/RM-32B",
                    **{k: str(v) for k, v in paths.items()})  # fmt: skip
    done = subprocess.run(["bash", str(SLURM / "vapo_qwen32b.sh")], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stdout[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("MISSING")]
    model, train, eval_, policy, critic = (str(p) for p in paths.values())
    assert lines == [
        f"MISSING  model.path={model}: no config.json; download it: "
        f"hf download Qwen/Qwen2.5-32B --local-dir {model}",
        f"MISSING  data.train_path={train}: python tools/prepare_data.py dapo-math-17k "
        f"--source BytedTsinghua-SIA/DAPO-Math-17k --out {train}",
        f"MISSING  data.eval_path={eval_}: python tools/prepare_data.py aime-2024 "
        f"--source BytedTsinghua-SIA/AIME-2024 --out {eval_}",
        f"MISSING  policy.load={policy}: python tools/convert.py hf-to-mcore --hf {model} "
        f"--out {policy} --tp 8 --pp 1",
        lines[-1],
    ]
    assert lines[-1].startswith(f"MISSING  critic.init_path={critic}: hf download "
                                f"example/RM-32B --local-dir {tmp_path / 'RM-32B'}, then ")  # fmt: skip
    assert "--critic-from reward-model" in lines[-1] and "--critic-from policy" in lines[-1]
    assert "inputs missing" in done.stderr
    assert last_json(done.stdout)["fits"] is True  # the plan is still printed


def test_dry_run_refuses_checkpoints_of_the_wrong_kind_and_bad_data(
    inputs: dict[str, str], tmp_path: Path
) -> None:
    bad_data = tmp_path / "train.jsonl"
    bad_data.write_text(json.dumps({"question": "Find x.", "solution": "204"}) + "\n")
    swapped = dict(inputs, POLICY_LOAD=inputs["CRITIC_INIT"], CRITIC_INIT=inputs["POLICY_LOAD"],
                   TRAIN_DATA=str(bad_data))  # fmt: skip
    done = subprocess.run(["bash", str(SLURM / "vapo_qwen7b_1node.sh")],
                          env=clean_env(DRY_RUN="1", SLURM_CPUS_PER_TASK="16", **swapped),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    out = done.stdout
    assert f"BAD      policy.load={inputs['CRITIC_INIT']}: " in out
    assert "this is a critic checkpoint" in out
    assert f"BAD      critic.init_path={inputs['POLICY_LOAD']}: " in out
    assert "this is a policy checkpoint" in out
    assert "--cpus-per-task=16" in out  # the job's value, when sbatch set one
    assert (
        f"BAD      data.train_path={bad_data}: {bad_data}: columns ['question', 'solution'] " in out
    )
    assert out.count("remake it: python tools/prepare_data.py dapo-math-17k --source ") == 1


def test_dry_run_refuses_a_world_the_recipe_cannot_use() -> None:
    # TP 8 x CP 2 = 16 ranks per replica does not divide 12 GPUs: the trainer's own check says so.
    env = clean_env(DRY_RUN="1", NODES="1", GPUS_PER_NODE="12")
    done = subprocess.run(["bash", str(SLURM / "vapo_qwen32b.sh")], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert "does not divide the world size 12" in done.stderr
    assert last_json(done.stdout)["valid"] is False


def slurm_job(tmp_path: Path, **extra: str) -> tuple[list[str], dict[str, str], Path]:
    """The 32B script as a fake one-node, two-GPU job running the tiny recipe."""
    assets = make_assets(tmp_path / "assets")
    log = tmp_path / "slurm.log"
    env = clean_env(
        PATH=f"{FAKE_BIN}{os.pathsep}{os.environ['PATH']}", FAKE_SLURM_LOG=str(log),
        SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="127.0.0.1",
        SLURM_SUBMIT_DIR=str(REPO_ROOT), MASTER_PORT=str(free_port()), GPUS_PER_NODE="2",
        CONTAINER_IMAGE="none", RECIPE="recipes/tiny_cpu.yaml", RUN_DIR=str(tmp_path / "run"),
        MODEL_PATH=assets["model.path"], TRAIN_DATA=assets["data.train_path"],
        EVAL_DATA=assets["data.eval_path"], OMP_NUM_THREADS="1",
        EXTRA_ARGS=f"model.create_tiny=false {SHORT}", PREFLIGHT="0",
        MODEL_PRESET=assets["model.path"],  # the preflight plans the model this job runs
    )  # fmt: skip
    env.update(extra)
    return ["bash", str(SLURM / "vapo_qwen32b.sh")], env, log


@pytest.mark.slow  # ~90 s on 2 shared cores: the tiny run's start-up dominates
def test_launch_path_runs_the_trainer_through_srun(tmp_path: Path) -> None:
    command, env, log = slurm_job(tmp_path)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    node_logs = list((tmp_path / "run" / "slurm_logs" / "4242" / "attempt-0").glob("*.log"))
    detail = (
        done.stdout[-2000:]
        + done.stderr[-2000:]
        + "".join(p.read_text()[-4000:] for p in node_logs)
    )
    assert done.returncode == 0, detail
    assert [p.name for p in node_logs] == ["fake-node-0.log"]
    calls = log.read_text()
    assert "srun --nodes=1 --ntasks-per-node=2" in calls
    assert "requeue" not in calls  # finished, not signalled
    assert max(read_metrics(tmp_path / "run")) == 1
    assert (tmp_path / "run" / "checkpoints" / "latest").exists()


@pytest.mark.slow
def test_usr1_saves_requeues_and_resumes(tmp_path: Path) -> None:
    """The time-limit path: USR1 to the batch shell -> every rank saves -> scontrol requeue;
    the same command again resumes from checkpoints/latest."""
    command, env, log = slurm_job(tmp_path, PREFLIGHT="1",
                                  EXTRA_ARGS=f"model.create_tiny=false {SHORT} trainer.steps=50")  # fmt: skip
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)  # fmt: skip
    run_dir, deadline = tmp_path / "run", time.monotonic() + 240
    while not ((run_dir / "metrics.jsonl").exists() and read_metrics(run_dir)):
        assert job.poll() is None and time.monotonic() < deadline, job.stdout.read()
        time.sleep(1)
    job.send_signal(signal.SIGUSR1)
    out, _ = job.communicate(timeout=240)
    assert job.returncode == 0, out[-4000:]
    assert "scontrol requeue 4242" in log.read_text(), out[-4000:]
    preflight = [line for line in log.read_text().splitlines() if "--ntasks=1" in line]
    assert "slurm/check_inputs.py" in preflight[0] and "tools/plan.py" in preflight[1]
    sruns = [line for line in log.read_text().splitlines() if line.startswith("srun ")]
    assert len(sruns) == 3 and all("--cpus-per-task=12" in line for line in sruns)
    saved = max(read_metrics(run_dir))
    assert 1 <= saved < 50
    env["SLURM_RESTART_COUNT"] = "1"
    env["EXTRA_ARGS"] = f"model.create_tiny=false {SHORT} trainer.steps={saved + 1}"
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-4000:]
    assert max(read_metrics(run_dir)) == saved + 1
    shutil.rmtree(tmp_path / "assets", ignore_errors=True)
