"""DeepSeek-V3 (MLA, plain RoPE and YaRN) and GLM-4.5 (partial RoPE, q/k/v biases, qk norms)
logits (policy) and values (critic) of the production model path equal transformers' at TP1,
TP2, PP2, CP2, EP2, TP2 x EP2 and under virtual pipeline stages (PP2 x VPP2, alone, with EP2
and with TP2), padded and packed (4 gloo ranks; ``workers/sigmoid_moe_parity_worker.py``):
the first layer dense, a shared expert, sigmoid routing with a non-zero expert bias, 4 groups
(top 2 of them), scaling 2.5. MoE layouts with TP > 1 run with sequence parallelism. Layouts
are TP x PP x CP x EP, then VPP where given: at PP2 x VPP2 the 4 layers make 4 chunks, pipeline
rank 0 holding the dense layer 0 and the MoE layer 2, so each chunk's layer offset picks its
own spec. The default tier runs PP2, PP2 x VPP2 and TP2 x EP2 (TP, EP, SP at once) of
DeepSeek-V3 in one launch and TP2 x EP2 of GLM-4.5 (~20-40 s per layout on 2 busy cores); the
slow tier every other layout and YaRN."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "sigmoid_moe_parity_worker.py"


def _check(family: str, layouts: list[str], timeout: float) -> None:
    outputs = "\n".join(run_workers(WORKER, 4, family, ",".join(layouts), timeout=timeout))
    for layout in layouts:
        for head in ("lm", "value"):
            for batch in ("pad", "pack"):
                assert f"{layout} {head} {batch}: max diff" in outputs


def test_deepseek_v3_matches_transformers_at_pp2_vpp2_and_tp2_ep2():
    _check("deepseek_v3", ["1x2x1x1", "1x2x1x1x2", "2x1x1x2"], timeout=400)


def test_glm4_moe_matches_transformers_at_tp2_ep2():
    _check("glm4_moe", ["2x1x1x2"], timeout=300)


@pytest.mark.slow
def test_deepseek_v3_yarn_matches_transformers_at_every_layout():
    _check("deepseek_v3_yarn", ["1x1x1x1", "2x1x1x1", "1x2x1x1", "1x1x2x1", "2x1x1x2"], 600)


@pytest.mark.slow
def test_sigmoid_moe_families_match_transformers_at_cp2_and_the_rest():
    _check("deepseek_v3", ["1x1x1x1", "2x1x1x1", "1x1x1x2", "1x1x2x1"], timeout=400)
    _check("glm4_moe", ["1x1x1x1", "2x1x1x1", "1x2x1x1", "1x1x1x2", "1x1x2x1"], timeout=500)


@pytest.mark.slow  # ~1.5 min per family on 2 busy cores
def test_sigmoid_moe_families_match_transformers_under_virtual_pipeline():
    _check("deepseek_v3", ["1x2x1x2x2", "2x2x1x1x2"], timeout=400)
    _check("glm4_moe", ["1x2x1x1x2", "1x2x1x2x2", "2x2x1x1x2"], timeout=500)
