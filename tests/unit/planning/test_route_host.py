"""Routing replay's host memory in the planner (``planning/host.py::route_host_parts``): the
route holder's store, one round's send buffer and what a rank receives, per GPU, in the table
and JSON of ``tools/plan.py`` (``planning/plan_report.py``)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.planning import host
from vapo_megatron.planning import memory as mp
from vapo_megatron.planning.plan_report import format_plan, plan_summary, route_parts
from vapo_megatron.planning.presets import GPUS, MODEL_PRESETS
from vapo_megatron.planning.workload import GIB, Workload

REPO = Path(__file__).resolve().parents[3]
SAMPLES, PROMPT, RESPONSE = 1024, 1000, 4000


def preset(name: str) -> HFModelConfig:
    return HFModelConfig.from_hf(MODEL_PRESETS[name])


def workload(**kw) -> Workload:
    return Workload(
        world_size=32, prompt_len=PROMPT, response_len=RESPONSE, micro_batch_tokens=16384,
        samples_per_step=SAMPLES, mean_response_fraction=0.5, rollout_tp=2,
        routing_replay=True, **kw,
    )  # fmt: skip


@pytest.mark.unit
@pytest.mark.parametrize(
    ("tp", "pp", "cp"), [(1, 1, 1), (2, 1, 1), (4, 1, 1), (2, 2, 1), (1, 2, 2)]
)
def test_holder_bytes_by_hand(tp, pp, cp) -> None:
    """Qwen3-30B-A3B (48 layers, top 8: 768 B a token), 1,024 samples of 1,000 + 2,000
    tokens on 32 ranks, vLLM TP 2 (16 replicas): the store is a replica's 1/16 of the step
    over every layer, a rank's share its DP's over its stage's 48 / PP layers, and a round's
    send buffer the store's size at any TP (each sample once per round)."""
    hf = preset("qwen3-30b-a3b")
    layout = ModelLayout(tp=tp, pp=pp, cp=cp, ep=1, sequence_parallel=tp > 1)
    parts = host.route_host_parts({"lm": (hf, layout)}, workload())
    step = SAMPLES * (PROMPT + RESPONSE // 2) * 48 * 8 * 2
    dp = 32 // (tp * pp * cp)
    assert parts["route_store"].nbytes == step // 16
    assert parts["policy_routes"].nbytes == step // dp // pp
    assert parts["route_exchange"].nbytes == max(step // 16, step // dp // pp)
    assert host.route_host_peak(parts) == step // 16 + step // dp // pp + max(
        step // 16, step // dp // pp
    )
    assert "critic_routes" not in parts


@pytest.mark.unit
def test_critic_routes_and_none_without_replay() -> None:
    moe, dense = preset("qwen3-30b-a3b"), preset("qwen3-32b")
    layout = ModelLayout(tp=2, pp=2, sequence_parallel=True)
    models = {"lm": (moe, layout), "value": (moe, layout)}
    parts = host.route_host_parts(models, workload(critic_routing_replay=True))
    step = SAMPLES * (PROMPT + RESPONSE // 2) * 48 * 8 * 2
    assert parts["critic_routes"].nbytes == step // 8 // 2
    # The critic's routes are recorded after the exchange: the peak counts the larger.
    exchange = parts["route_exchange"].nbytes
    assert host.route_host_peak(parts) == step // 16 + step // 16 + max(exchange, step // 16)
    assert host.route_host_parts(models, workload()).keys() == parts.keys() - {"critic_routes"}
    no_replay = Workload(world_size=32, prompt_len=PROMPT, response_len=RESPONSE,
                         micro_batch_tokens=16384)  # fmt: skip
    assert host.route_host_parts(models, no_replay) == {}  # neither model replays: none
    assert host.route_host_parts({"lm": (dense, layout)}, workload()) == {}


@pytest.mark.unit
def test_plan_reports_the_holders_bytes() -> None:
    hf = preset("qwen3-30b-a3b")
    layout = ModelLayout(tp=2, ep=8, sequence_parallel=True)
    result = mp.plan(hf, GPUS["h100-80gb"], layout, layout, workload())
    routes = route_parts(result, hf)
    assert set(routes) == {"route_store", "route_exchange", "policy_routes"}
    table = format_plan(result, "30B", routes)
    for name in routes:
        assert name in table
    summary = plan_summary(result, routes)
    assert summary["route_host_peak_gib_per_gpu"] == round(host.route_host_peak(routes) / GIB, 2)
    assert summary["route_host_gib_per_gpu"]["route_store"]["label"] == "estimated"


@pytest.mark.unit
def test_recipe_plan_counts_the_route_holder(capsys) -> None:
    """``tools/plan.py --recipe`` on the 30B-A3B recipe (R3 on, an MoE critic replaying its
    own routes) reports the holder's bytes; they equal route_host_parts' at its workload."""
    spec = importlib.util.spec_from_file_location("plan_tool", REPO / "tools" / "plan.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    recipe = str(REPO / "recipes" / "vapo_qwen3_30b_a3b.yaml")
    assert tool.main(["--recipe", recipe, "--model", "qwen3-30b-a3b", "--nodes", "4"]) == 0
    text = capsys.readouterr().out
    out = json.loads(text.strip().splitlines()[-1])
    parts = out["route_host_gib_per_gpu"]
    assert set(parts) == {"route_store", "route_exchange", "policy_routes", "critic_routes"}
    assert "routing replay: ordinary host memory" in text
    store = parts["route_store"]["gib"]
    assert store > 1 and parts["route_exchange"]["gib"] == store  # TP 2: one store per round
    assert out["route_host_peak_gib_per_gpu"] == pytest.approx(3 * store, abs=0.02)
