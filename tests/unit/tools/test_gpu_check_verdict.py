"""tools/gpu_check.py's ending (issue 40): the summary line, which skips fail the check, and
the parts that skip for a missing library or GPU (``tools/gpu_checks/verdict.py``).

On a GPU a part skipped because Transformer Engine, vLLM or a second GPU is missing used to
leave ``ok`` true (``OPTIONAL_PARTS``); now a skip of a part the recipe needs fails the check
unless the caller accepts it by name, and with ``--cpu`` skips are listed but never fatal.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.launcher import REPO_ROOT
from vapo_megatron.config.recipe import load_recipe

sys.path.insert(0, str(REPO_ROOT / "tools"))
from gpu_checks import verdict  # noqa: E402  (tools/ is not a package)
from gpu_checks.frame import Results, Skipped  # noqa: E402
from gpu_checks.moe_ep_part import moe_ep  # noqa: E402
from gpu_checks.moe_te_part import moe_te  # noqa: E402
from gpu_checks.parts import PARTS  # noqa: E402
from gpu_checks.vllm_routes_part import vllm_routes  # noqa: E402

pytestmark = pytest.mark.unit
RECIPES = REPO_ROOT / "recipes"
NO_TE = (False, "ModuleNotFoundError: No module named 'transformer_engine'")


def part_results(skips: dict[str, tuple[str, str | None]], failed=()) -> dict[str, dict]:
    """Every part ok but ``skips`` (part -> (reason, missing)) and ``failed``, as Results
    records them."""
    results = Results(torch.device("cpu"))
    for name in PARTS:

        def part(numbers, name=name):
            if name in skips:
                reason, missing = skips[name]
                raise Skipped(reason, missing=missing)
            if name in failed:
                raise RuntimeError("boom")

        results.run(name, part)
    return results.parts


def final(parts, *, recipe=None, accepted=(), on_gpu=True) -> dict:
    config = None if recipe is None else load_recipe(RECIPES / recipe)
    return verdict.summary(
        parts, list(PARTS), {"device": "x"}, time.perf_counter(),
        needs=verdict.recipe_needs(config), accepted=set(accepted), on_gpu=on_gpu,
    )  # fmt: skip


TE_MISSING = {
    "te_spec": (f"transformer_engine not importable ({NO_TE[1]})", "transformer_engine"),
    "moe_te": (f"transformer_engine not importable ({NO_TE[1]})", "transformer_engine"),
}


def test_summary_line_counts_and_says_why():
    parts = part_results(TE_MISSING, failed=["offload"])
    line = verdict.summary_line(final(parts, recipe="tiny_cpu.yaml", on_gpu=False))
    assert line.startswith(f"passed {len(PARTS) - 3}, skipped 2 (te_spec: transformer_engine")
    assert "; moe_te: transformer_engine not importable" in line
    assert line.endswith("), failed 1")
    clean = verdict.summary_line(final(part_results({}), on_gpu=False))
    assert clean == f"passed {len(PARTS)}, skipped 0, failed 0"


def test_moe_recipe_with_te_skipped_fails_on_gpu_unless_accepted():
    parts = part_results(TE_MISSING)
    result = final(parts, recipe="vapo_qwen3_30b_a3b.yaml")
    assert verdict.exit_code(result) == 1 and not result["ok"]
    assert set(result["blocking_skips"]) == {"te_spec", "moe_te"}
    assert "MoE model" in result["blocking_skips"]["moe_te"]
    assert "FAILS THE CHECK" in verdict.summary_line(result)
    accepted = final(parts, recipe="vapo_qwen3_30b_a3b.yaml", accepted=["te_spec", "moe_te"])
    assert verdict.exit_code(accepted) == 0 and accepted["blocking_skips"] == {}
    assert "[accepted]" in verdict.summary_line(accepted)
    one = final(parts, recipe="vapo_qwen3_30b_a3b.yaml", accepted=["te_spec"])
    assert verdict.exit_code(one) == 1 and set(one["blocking_skips"]) == {"moe_te"}


def test_cpu_skips_never_fail_and_needless_skips_do_not_either():
    parts = part_results(TE_MISSING)
    assert verdict.exit_code(final(parts, recipe="tiny_moe_cpu.yaml", on_gpu=False)) == 0
    # A dense recipe of short rows at CP 1 needs no Transformer Engine...
    dense = final(parts, recipe="tiny_cpu.yaml")
    assert "te_spec" not in dense["needs"] and verdict.exit_code(dense) == 0
    # ...but the 32B recipe does (CP 2, rows of 22k tokens), and so does "every recipe".
    assert verdict.exit_code(final(parts, recipe="vapo_qwen2.5_32b.yaml")) == 1
    assert verdict.exit_code(final(parts)) == 1
    # Skipped for --cpu (nothing missing) on a GPU run never blocks; a failure always does.
    by_design = part_results({"te_spec": ("Transformer Engine runs on CUDA only (--cpu)", None)})
    assert verdict.exit_code(final(by_design)) == 0
    assert verdict.exit_code(final(part_results({}, failed=["moe"]), on_gpu=False)) == 1


def test_recipe_needs():
    needs = verdict.recipe_needs(load_recipe(RECIPES / "vapo_qwen3_30b_a3b.yaml"))
    assert set(needs) == {"te_spec", "moe_te", "moe_ep", "vllm_routes"}
    assert needs["moe_ep"] == "expert parallelism 8"
    dense = verdict.recipe_needs(load_recipe(RECIPES / "tiny_cpu.yaml"))
    assert set(dense) == {"vllm_routes"}
    assert set(verdict.recipe_needs(None)) == set(verdict.GATED_PARTS)


def test_accept_skipped_names_are_checked():
    assert verdict.parse_accepted("te_spec, vllm_routes") == {"te_spec", "vllm_routes"}
    assert verdict.parse_accepted("") == set()
    with pytest.raises(ValueError, match="te_sepc"):
        verdict.parse_accepted("te_sepc")
    with pytest.raises(ValueError, match="not a part"):
        verdict.parse_accepted("offload")  # runs everywhere: nothing to accept


def ctx(*, cuda: bool, te=NO_TE, vllm=(True, "0.32.0"), gpus: int = 1):
    """What the new parts read before they run anything."""
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    return SimpleNamespace(device=device, te=te, vllm=vllm, gpus=gpus if cuda else 0,
                           workdir=Path("/nonexistent"), results=None)  # fmt: skip


def skip_of(part, context) -> Skipped:
    with pytest.raises(Skipped) as info:
        part(context, {})
    return info.value


def test_moe_te_skips_without_te_marked_missing_and_on_cpu_unmarked():
    skip = skip_of(moe_te, ctx(cuda=True))
    assert skip.missing == "transformer_engine" and "No module named" in str(skip)
    skip = skip_of(moe_te, ctx(cuda=False))
    assert skip.missing is None and "--cpu" in str(skip)


def test_moe_ep_skips_on_one_gpu():
    skip = skip_of(moe_ep, ctx(cuda=True, gpus=1))
    assert skip.missing == "devices" and str(skip) == "EP 2 needs 2 GPUs, 1 visible"


def test_vllm_routes_skips_without_vllm_or_second_gpu_and_on_cpu():
    skip = skip_of(vllm_routes, ctx(cuda=True, vllm=(False, "no module named 'vllm'"), gpus=2))
    assert skip.missing == "vllm" and "no module named 'vllm'" in str(skip)
    skip = skip_of(vllm_routes, ctx(cuda=True, gpus=1))
    assert skip.missing == "devices" and "2 GPUs, 1 visible" in str(skip)
    skip = skip_of(vllm_routes, ctx(cuda=False))
    assert skip.missing is None and "--cpu" in str(skip)
