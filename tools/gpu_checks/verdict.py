"""The check's verdict: which parts the named recipe needs, which skips the caller accepts,
the JSON summary, the last line (``passed N, skipped M (why), failed K``) and the exit status.

Four parts can skip for something missing on the machine (``frame.Skipped.missing``): the
dense Transformer Engine spec (``te_spec``), the MoE TE spec (``moe_te``), EP 2 on two GPUs
(``moe_ep``) and vLLM TP 2 with routed experts (``vllm_routes``). The rule:

- On a GPU, a part the recipe needs that was skipped because a library (Transformer Engine,
  vLLM) or a second GPU is missing fails the check (exit 1), exactly as a failed part does,
  unless the caller names it in ``--accept-skipped``. ``--recipe`` says which parts the run
  needs (:func:`recipe_needs`); without it the check holds every gated part as needed (the
  strictest reading: every recipe of the project), so a bare run on one GPU without TE or vLLM
  exits 1 until its skips are accepted by name.
- With ``--cpu`` no skip fails the check: the CPU twin cannot load TE or vLLM's CUDA build, and
  its skips are listed, with their reasons, in the last line. Exit 0 iff no part failed.
- A part that failed always fails the check; ``hf_logits`` (skipped only when transformers is
  absent) is never needed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

GATED_PARTS = {
    "te_spec": "Transformer Engine's dense layer spec",
    "moe_te": "Transformer Engine's MoE spec (grouped GEMM, permute fusion, alltoall)",
    "moe_ep": "expert parallelism 2 over two GPUs (alltoall dispatcher)",
    "vllm_routes": "vLLM TP 2 with routed experts (record_routes)",
}
"""The parts that skip where a library or a second GPU is missing, and what each checks."""

EVERY_RECIPE = "no --recipe named: held to every recipe's needs"


def parse_accepted(text: str | None) -> set[str]:
    """``--accept-skipped`` ("te_spec,vllm_routes") as a set of part names; ValueError for a
    name that is not a gated part (a typo would otherwise accept nothing, silently)."""
    if not text:
        return set()
    names = {name.strip() for name in text.split(",") if name.strip()}
    unknown = sorted(names - set(GATED_PARTS))
    if unknown:
        raise ValueError(
            f"--accept-skipped {','.join(unknown)}: not a part that can be skipped for a "
            f"missing library or GPU; choose from {','.join(GATED_PARTS)}"
        )
    return names


def recipe_needs(config) -> dict[str, str]:
    """Gated part -> why the recipe ``config`` (a ``TrainConfig``; None: every recipe) needs it.

    vLLM: every recipe rolls out with it. Transformer Engine: an MoE model (TE's grouped-GEMM
    experts on a GPU), context parallelism > 1 or rows over the local spec's dense-attention
    bound (``provider.check_local_attention_fits`` refuses both on a GPU). EP 2 on two GPUs:
    an MoE layout with ``ep > 1``."""
    if config is None:
        return dict.fromkeys(GATED_PARTS, EVERY_RECIPE)
    from vapo_megatron.models.provider import LOCAL_ATTENTION_MAX_TOKENS

    layouts = [config.policy.layout]
    if config.algorithm.uses_critic:
        layouts.append(config.critic.layout)
    needs = {"vllm_routes": "its rollout runs on vLLM"}
    moe = moe_reason(config, layouts)
    row = max(config.data.max_prompt_tokens + config.rollout.max_new_tokens,
              config.trainer.micro_batch_tokens)  # fmt: skip
    cp = max(layout.cp for layout in layouts)
    if moe:
        needs["te_spec"] = f"{moe} (TE's experts on a GPU)"
        needs["moe_te"] = f"{moe} (TE's grouped-GEMM experts on a GPU)"
    elif cp > 1:
        needs["te_spec"] = f"context parallelism {cp} needs TE's attention on a GPU"
    elif row > LOCAL_ATTENTION_MAX_TOKENS:
        needs["te_spec"] = f"rows of {row} tokens > {LOCAL_ATTENTION_MAX_TOKENS} (local attention)"
    ep = max(layout.ep for layout in layouts)
    if moe and ep > 1:
        needs["moe_ep"] = f"expert parallelism {ep}"
    return needs


def moe_reason(config, layouts) -> str | None:
    """Why the recipe's model is a mixture of experts, or None: an EP layout, routing replay,
    the tiny MoE family, or experts in ``model.path``'s config.json when it is on this
    machine."""
    if any(layout.ep > 1 for layout in layouts):
        return "MoE model (ep > 1)"
    if config.algorithm.routing_replay != "none":
        return "MoE model (routing replay)"
    family = config.model.tiny_family
    if config.model.create_tiny and family in ("qwen3_moe", "deepseek_v3", "glm4_moe"):
        return f"MoE model (tiny {family})"
    path = Path(config.model.path, "config.json")
    hf = json.loads(path.read_text()) if path.is_file() else {}
    if hf.get("num_experts") or hf.get("n_routed_experts"):
        return f"MoE model ({path})"
    return None


def blocking(parts: dict[str, dict], needs: dict[str, str], accepted: set[str], on_gpu: bool):
    """Part -> why its skip fails the check (see the module doc)."""
    if not on_gpu:
        return {}
    return {
        name: f"needed: {needs[name]}"
        for name, r in parts.items()
        if r["status"] == "skipped" and r.get("missing") and name in needs and name not in accepted
    }


def summary(
    parts: dict[str, dict],
    names: list[str],
    header: dict,
    started: float,
    *,
    needs: dict[str, str],
    accepted: set[str],
    on_gpu: bool,
) -> dict:
    """The JSON line: ``ok`` only when every part of ``names`` ran and none failed, and no
    skip of a needed part is left unaccepted on a GPU (``blocking``)."""
    parts = dict(parts)
    for name in names:
        parts.setdefault(name, {"status": "failed", "error": "not run: the check timed out"})
    failed = sorted(n for n, r in parts.items() if r["status"] == "failed")
    blocked = blocking(parts, needs, accepted, on_gpu)
    return {
        "ok": not failed and not blocked,
        **header,
        "wall_seconds": round(time.perf_counter() - started, 2),
        "skipped": {n: r["error"] for n, r in parts.items() if r["status"] == "skipped"},
        "blocking_skips": blocked,
        "accepted_skips": sorted(accepted),
        "needs": needs,
        "failed": failed,
        "parts": parts,
    }


def summary_line(final: dict) -> str:
    """``passed N, skipped M (part: why; ...), failed K``: a needed skip says it fails the
    check, an accepted one says so."""
    parts = final["parts"]
    count = {s: sum(r["status"] == s for r in parts.values()) for s in ("ok", "skipped", "failed")}
    whys = []
    for name, why in final["skipped"].items():
        if name in final["blocking_skips"]:
            why += f" [FAILS THE CHECK: {final['blocking_skips'][name]}; --accept-skipped {name}]"
        elif name in final["accepted_skips"]:
            why += " [accepted]"
        whys.append(f"{name}: {why}")
    skipped = f"skipped {count['skipped']}" + (f" ({'; '.join(whys)})" if whys else "")
    return f"passed {count['ok']}, {skipped}, failed {count['failed']}"


def exit_code(final: dict) -> int:
    return 0 if final["ok"] else 1
