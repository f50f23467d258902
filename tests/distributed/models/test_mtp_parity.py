"""DeepSeek-V3's multi-token-prediction layer built in megatron (``models/mtp.py``, the policy
with ``policy.mtp.loss_weight`` > 0): the main logits equal transformers' and the MTP head's
logits equal a plain-torch reference made of transformers' modules (``eh_proj(cat[enorm(emb(t+1)),
hnorm(h_t)])`` -> a DeepseekV3DecoderLayer -> ``shared_head.norm`` -> lm head), padded and
packed, at TP1 (1 rank) and TP2, PP2, EP2, TP2 x EP2 (4 gloo ranks; TP > 1 with sequence
parallelism; ``workers/mtp_parity_worker.py``). The default tier runs TP1 on one rank (~30 s
on 2 busy cores); the slow tier the four 4-rank layouts (~100 s), and GLM-4.5's MTP layer
(GQA with partial RoPE) at TP1, PP2 and TP2 x EP2."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "mtp_parity_worker.py"


def _check(layouts: list[str], ranks: int, timeout: float, family: str = "deepseek_v3") -> None:
    outputs = "\n".join(run_workers(WORKER, ranks, ",".join(layouts), family, timeout=timeout))
    for layout in layouts:
        for batch in ("pad", "pack"):
            assert f"{layout} {batch}: max diff main" in outputs


def test_mtp_head_matches_the_reference_at_tp1():
    _check(["1x1x1x1"], 1, timeout=300)


@pytest.mark.slow
def test_glm4_moe_mtp_head_matches_the_reference():
    _check(["1x1x1x1"], 1, timeout=300, family="glm4_moe")
    _check(["1x2x1x1", "2x1x1x2"], 4, timeout=500, family="glm4_moe")


@pytest.mark.slow
def test_mtp_head_matches_the_reference_at_tp2_pp2_ep2_and_tp2_ep2():
    _check(["2x1x1x1", "1x2x1x1", "1x1x1x2", "2x1x1x2"], 4, timeout=600)
