"""``vapo-train RECIPE --dry-run``: one process standing in for ranks of an N-rank job.

The tiny recipe's dry run at world 2 equals a real 2-rank gloo build of the same recipe
(groups, parameter counts, every byte figure, and the checkpoint tensors each rank writes
against the files megatron's writer really wrote); the 32B recipe at world 128 and the 7B
recipe at world 8 build, and agree with the planner's exact parameter counts; a world size the
layout cannot use fails with the real run's message. The slow tier runs the MoE recipes at
their world sizes (Qwen3-235B at 256, DeepSeek-V3 at 1024, GLM-4.5 at 512 over 4 stages).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.trainer_runs import make_assets, plain_env
from tests.launcher import REPO_ROOT, run_workers

pytestmark = pytest.mark.distributed
TRAIN = REPO_ROOT / "vapo_megatron" / "train.py"
TINY = REPO_ROOT / "recipes" / "tiny_cpu.yaml"
WORKER = Path(__file__).parent / "workers" / "dry_run_worker.py"


def dry_run(recipe: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TRAIN), str(REPO_ROOT / "recipes" / recipe), "--dry-run", *args],
        env={**plain_env(), "PYTHONWARNINGS": "ignore"}, cwd=REPO_ROOT, capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> list[str]:
    made = make_assets(tmp_path_factory.mktemp("dry_run_assets"))
    return [f"{k}={v}" for k, v in made.items()]


@pytest.mark.timeout(300)
def test_tiny_dry_run_equals_a_real_two_rank_build(assets: list[str], tmp_path: Path) -> None:
    outputs = run_workers(WORKER, 2, str(tmp_path / "ckpt"), str(TINY), *assets, timeout=240)
    real = {}
    for text in outputs:
        line = next(x for x in text.splitlines() if x.startswith("DRYRUN-REAL "))
        found = json.loads(line.removeprefix("DRYRUN-REAL "))
        real[found["rank"]] = found
    done = dry_run("tiny_cpu.yaml", "--world-size", "2", "--ranks", "0,1", *assets)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    dry = {r["rank"]: r for r in last_json(done.stdout)["ranks"]}
    for rank in (0, 1):
        for role in ("policy", "critic"):
            want, have = real[rank][role], dry[rank][role]
            assert have["groups"] == want["groups"], (rank, role)
            assert have["param_count"] == want["param_count"] == have["planned_param_count"]
            for key in ("params", "param_buffer", "grads", "optimizer"):
                assert have["built_bytes"][key] == want["built_bytes"][key], (rank, role, key)
            # The files hold the tensors this rank writes plus torch's framing of each (~3 %
            # on tensors this small): a shard assigned to the wrong rank would be far off.
            written = have["built_bytes"]["checkpoint"]
            on_disk = sum(n for f, n in real[rank]["written"].items() if f.startswith(role))
            assert written <= on_disk <= written * 1.05, (rank, role, written, on_disk)
            if len(have["groups"]["dp_cp"]) == 1:  # nothing to balance: the planner is exact
                assert written == have["planned_bytes"]["checkpoint"], (rank, role)
    # The tiny policy is TP 2 (each rank its own half), the critic DP 2 (replicas split):
    # layouts that differ route the critic's advantages to the policy's owners.
    assert dry[0]["data_path"] == dry[1]["data_path"] == "routed"
    assert dry[0]["policy"]["groups"]["tp"] == [0, 1]
    assert dry[0]["critic"]["groups"]["dp"] == [0, 1]


@pytest.mark.timeout(180)
def test_32b_recipe_at_world_128_builds_and_agrees_with_the_planner() -> None:
    done = dry_run("vapo_qwen2.5_32b.yaml", "--world-size", "128", "--ranks", "0,127",
                   "--model", "qwen2.5-32b")  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = last_json(done.stdout)
    assert summary["world_size"] == 128 and [r["rank"] for r in summary["ranks"]] == [0, 127]
    first, last = summary["ranks"]
    for report in (first, last):
        for role in ("policy", "critic"):
            model = report[role]
            assert model["layout"] == {"tp": 8, "pp": 1, "cp": 2, "dp": 8}
            assert model["param_count"] == model["planned_param_count"]
            built, planned = model["built_bytes"], model["planned_bytes"]
            for key in ("params", "grads", "optimizer"):  # DP x CP = 16 divides every bucket
                assert built[key] == planned[key], (role, key)
            assert abs(built["checkpoint"] - planned["checkpoint"]) < 0.01 * planned["checkpoint"]
            shares = model["checkpoint"]  # megatron's plan: this rank's part of its group's
            assert shares["weights_bytes"] + shares["optimizer_bytes"] == built["checkpoint"]
            assert 0 < shares["weights_tensors"] < shares["group_tensors"] / 16
            assert model["data"]["samples"] == 512 * 16 // 8
    assert first["policy"]["groups"]["tp"] == list(range(8))
    assert first["policy"]["groups"]["cp"] == [0, 8]
    assert first["policy"]["groups"]["dp"] == list(range(0, 128, 16))
    assert last["policy"]["coords"] == {"tp": 7, "pp": 0, "cp": 1, "dp": 7}
    assert first["vllm_replica_ranks"] == [0, 1, 2, 3] and last["vllm_replica"] == 31
    # One layout for both models: each DP rank keeps its samples, GAE on the CP shards.
    assert first["data_path"] == last["data_path"] == "shards"
    assert "data path     shards (2 model(s) on one layout (tp=8, pp=1, cp=2" in done.stdout
    assert "== rank 127 of 128" in done.stdout and "not built" in done.stdout


@pytest.mark.timeout(120)
def test_7b_recipe_at_world_8() -> None:
    done = dry_run("vapo_qwen2.5_7b.yaml", "--world-size", "8", "--ranks", "0,3,7",
                   "--model", "qwen2.5-7b")  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for report in last_json(done.stdout)["ranks"]:
        for role in ("policy", "critic"):
            model = report[role]
            assert model["layout"] == {"tp": 4, "pp": 1, "cp": 1, "dp": 2}
            assert model["param_count"] == model["planned_param_count"]
            assert model["built_bytes"]["params"] == model["planned_bytes"]["params"]
    assert [r["vllm_replica"] for r in last_json(done.stdout)["ranks"]] == [0, 1, 3]


@pytest.mark.slow  # CI time (~45 s); test_slurm.py's world refusal runs by default
@pytest.mark.timeout(180)
def test_a_world_the_layout_cannot_use_fails_as_the_real_run_does(
    assets: list[str], tmp_path: Path
) -> None:
    # The tiny policy is TP 2: 3 ranks cannot hold it.
    real = subprocess.run(
        [sys.executable, str(TRAIN), str(TINY), *assets, "trainer.local_world_size=3",
         f"trainer.run_dir={tmp_path / 'run'}", "trainer.progress_bar=false"],
        env={**plain_env(), "PYTHONWARNINGS": "ignore"}, cwd=REPO_ROOT, capture_output=True,
        text=True, timeout=150,
    )  # fmt: skip
    assert real.returncode != 0
    log = (tmp_path / "run" / "logs").glob("*")
    real_text = real.stdout + real.stderr + "".join(p.read_text() for p in log if p.is_file())
    dry = dry_run("tiny_cpu.yaml", "--world-size", "3", *assets)
    assert dry.returncode == 2, dry.stdout[-2000:] + dry.stderr[-2000:]
    message = next(x for x in dry.stderr.splitlines() if " ERROR " in x).split(" ERROR ", 1)[1]
    assert "does not divide the world size 3" in message
    assert message in real_text


def test_ranks_outside_the_world_are_refused() -> None:
    done = dry_run("vapo_qwen2.5_7b.yaml", "--world-size", "8", "--ranks", "0,8",
                   "--model", "qwen2.5-7b", timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert "--ranks [0, 8]: each must be in 0..7" in done.stderr


def assert_planner_bytes(report: dict, role: str) -> None:
    """Parameters, grads and Adam of the built objects equal the planner's to the byte."""
    model = report[role]
    assert model["param_count"] == model["planned_param_count"], (role, model["layout"])
    built, planned = model["built_bytes"], model["planned_bytes"]
    for key in ("params", "grads", "optimizer"):
        assert built[key] == planned[key], (report["rank"], role, key, built, planned)


@pytest.mark.slow  # ~2.5 min on 2 shared cores: 48 checkpoint peers built on meta
@pytest.mark.timeout(900)
def test_rm7b_recipe_at_world_128_builds_each_model_from_its_own_config() -> None:
    """The 32B policy and the 7B critic of its own (critic.model, a preset here), each at the
    layout the planner picked, built by the trainer's code at 128 ranks."""
    done = dry_run("vapo_qwen2.5_32b_rm7b.yaml", "--world-size", "128", "--ranks", "0,127",
                   "--model", "qwen2.5-32b", "critic.model=acemath-7b-rm-32k", timeout=840)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    first, last = last_json(done.stdout)["ranks"]
    for report in (first, last):
        assert report["policy"]["layout"] == {"tp": 4, "pp": 1, "cp": 1, "dp": 32}
        assert report["critic"]["layout"] == {"tp": 4, "pp": 2, "cp": 1, "dp": 16}
        for role in ("policy", "critic"):
            assert_planner_bytes(report, role)
        assert report["data_path"] == "routed"  # another layout: values go to the owners
    # 28 layers of 3584 over TP 4 and PP 2, the last stage with the value head.
    assert (first["critic"]["coords"]["pp"], last["critic"]["coords"]["pp"]) == (0, 1)
    assert first["critic"]["param_count"] != last["critic"]["param_count"]
    assert "with the critic acemath-7b-rm-32k at world size 128" in done.stdout


@pytest.mark.slow  # minutes: 96 checkpoint peers of a 235B MoE and a 32B critic on meta
@pytest.mark.timeout(3000)
def test_235b_recipe_at_world_256_agrees_with_the_planner() -> None:
    """Qwen3-235B-A22B at TP 8 x EP 32 (expert TP 8, expert DP 1: the layout whose weight
    sync fits, docs/scaling.md) with its Qwen3-32B critic at TP 8, 256 ranks: the expert
    groups and the experts' Adam, to the byte."""
    done = dry_run("vapo_qwen3_235b_a22b.yaml", "--world-size", "256", "--ranks", "0,255",
                   "--model", "qwen3-235b-a22b", "critic.model=qwen3-32b", timeout=2900)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    first, last = last_json(done.stdout)["ranks"]
    for report in (first, last):
        policy = report["policy"]
        assert policy["layout"] == {"tp": 8, "pp": 1, "cp": 1, "dp": 32, "ep": 32, "etp": 8,
                                    "edp": 1}  # fmt: skip
        assert report["critic"]["layout"] == {"tp": 8, "pp": 1, "cp": 1, "dp": 32}
        for role in ("policy", "critic"):
            assert_planner_bytes(report, role)
        assert len(policy["groups"]["ep"]) == 32 and len(policy["groups"]["expt_dp"]) == 1
    assert first["policy"]["coords"]["ep"] == 0 and last["policy"]["coords"]["ep"] == 31
    assert first["vllm_replica_ranks"] == list(range(8)) and last["vllm_replica"] == 31


@pytest.mark.slow  # 27 min (389 s of CPU) on 2 cores at load 5-12: 2 x 128 checkpoint peers
@pytest.mark.timeout(3600)
def test_deepseek_v3_recipe_at_world_1024_agrees_with_the_planner() -> None:
    """DeepSeek-V3 (MLA, 3 dense + 58 MoE layers of 256 experts, a shared expert) at TP 8 x
    EP 128 (expert TP 8, expert DP 1) for both models, 1024 ranks, the recipe as written:
    ranks 0, 512 and 1016 share their DP x CP group (TP rank 0, so the 2 x 128 peers are
    built once) and hold experts 0-1, 128-129 and 254-255; parameters, grads and Adam to the
    byte."""
    done = dry_run("vapo_deepseek_v3.yaml", "--world-size", "1024", "--ranks", "0,512,1016",
                   "--model", "deepseek-v3", timeout=3500)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reports = last_json(done.stdout)["ranks"]
    for report, ep_rank in zip(reports, (0, 64, 127), strict=True):
        for role in ("policy", "critic"):
            model = report[role]
            assert model["layout"] == {"tp": 8, "pp": 1, "cp": 1, "dp": 128, "ep": 128,
                                       "etp": 8, "edp": 1}  # fmt: skip
            assert model["coords"]["ep"] == ep_rank and model["coords"]["tp"] == 0
            assert_planner_bytes(report, role)
            assert len(model["groups"]["ep"]) == 128 and len(model["groups"]["expt_dp"]) == 1
            # Megatron's save plan gives each tensor the DP ranks hold alike to one of them
            # whole, the planner divides those bytes evenly: rank 0 writes the embedding's TP
            # shard (233 MB, +198 MB: 2.2 %), 512 and 1016 -3.5 and -3.8 MB.
            built, planned = model["built_bytes"], model["planned_bytes"]
            assert abs(built["checkpoint"] - planned["checkpoint"]) < 0.03 * planned["checkpoint"]
        assert report["data_path"] == "shards"
    assert [r["vllm_replica"] for r in reports] == [0, 8, 15]


@pytest.mark.slow  # 6 min on 2 cores at load ~8 (76 s of CPU): 3 stages x 2 models x 16 peers
@pytest.mark.timeout(1800)
def test_glm45_at_world_512_agrees_with_the_planner_on_every_stage() -> None:
    """GLM-4.5 (the planner preset; no recipe of its own: the DeepSeek-V3 recipe's settings)
    at docs/scaling.md's layout, TP 8 x PP 4 x EP 16 for both models on 512 ranks: the first
    stage (embedding, the 3 dense layers), a middle one and the last (the LM head, the value
    head), parameters, grads and Adam to the byte."""
    layout = ["policy.layout.pp=4", "policy.layout.ep=16", "critic.layout.pp=4",
              "critic.layout.ep=16", "rollout.tensor_parallel_size=16"]  # fmt: skip
    done = dry_run("vapo_deepseek_v3.yaml", "--world-size", "512", "--ranks", "0,300,511",
                   "--model", "glm-4.5", *layout, timeout=1700)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reports = last_json(done.stdout)["ranks"]
    for report, pp_rank in zip(reports, (0, 2, 3), strict=True):
        for role in ("policy", "critic"):
            model = report[role]
            assert model["layout"] == {"tp": 8, "pp": 4, "cp": 1, "dp": 16, "ep": 16,
                                       "etp": 8, "edp": 1}  # fmt: skip
            assert model["coords"]["pp"] == pp_rank
            assert_planner_bytes(report, role)
            built, planned = model["built_bytes"], model["planned_bytes"]  # whole tensors, +1.3 %
            assert abs(built["checkpoint"] - planned["checkpoint"]) < 0.03 * planned["checkpoint"]
    first, middle, last = reports
    assert first["policy"]["param_count"] != middle["policy"]["param_count"]
    # The last stage's LM head against the critic's value head: 151,552 x 5,120 / TP 8 - 5,120.
    heads = last["policy"]["param_count"] - last["critic"]["param_count"]
    assert heads == 151552 * 5120 // 8 - 5120


@pytest.mark.timeout(240)
def test_separate_placement_builds_the_trainer_ranks_only(assets: list[str]) -> None:
    """rollout.placement=separate (issue 42): the models are built over the trainer ranks
    (the first world - rollout.ranks), with the bytes of the same layout colocated on that
    many ranks; a rollout rank builds nothing and is refused with the ranks to ask for."""
    done = dry_run("tiny_cpu_async.yaml", "--world-size", "3", "--ranks", "0,1", *assets)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    colocated = dry_run("tiny_cpu.yaml", "--world-size", "2", "--ranks", "0,1", *assets)
    assert colocated.returncode == 0, colocated.stderr[-3000:]
    separate, together = last_json(done.stdout), last_json(colocated.stdout)
    assert separate["world_size"] == 2  # the trainer ranks the models are built over
    for mine, theirs in zip(separate["ranks"], together["ranks"], strict=True):
        assert mine["vllm_replica"] is None and mine["vllm_replica_ranks"] == [2]
        for role in ("policy", "critic"):
            assert mine[role]["layout"] == theirs[role]["layout"]
            assert mine[role]["built_bytes"] == theirs[role]["built_bytes"]
            assert mine[role]["built_bytes"]["params"] == mine[role]["planned_bytes"]["params"]
    assert "of 2 trainer ranks: no vLLM (separate placement: ranks [2]" in done.stdout
    refused = dry_run("tiny_cpu_async.yaml", "--world-size", "3", "--ranks", "2", *assets)
    assert refused.returncode != 0
    assert "ranks 2..2 only generate" in refused.stdout + refused.stderr
