"""The planner's results as a reader sees them: one line per layout and recompute setting, a
JSON-able summary of a plan, and the plan's table by phase."""

from __future__ import annotations

import math

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.planning.host import HostPart, Models, route_host_parts, route_host_peak
from vapo_megatron.planning.memory import Plan
from vapo_megatron.planning.placement import Colocated, Separate
from vapo_megatron.planning.vllm import DECODE_EFFICIENCY
from vapo_megatron.planning.workload import GIB, OFFLOADS, Recompute


def layout_summary(layout: ModelLayout, world_size: int) -> dict[str, object]:
    """{"tp", "pp", "cp", "dp", "vpp", "sequence_parallel"} of one model, and under expert
    parallelism {"ep", "etp", "edp"} (expert TP and expert DP as in effect)."""
    dp = world_size // (layout.tp * layout.pp * layout.cp)
    out: dict[str, object] = {"tp": layout.tp, "pp": layout.pp, "cp": layout.cp, "dp": dp,
                              "vpp": layout.vpp, "sequence_parallel": layout.sequence_parallel}  # fmt: skip
    if layout.ep > 1 or layout.etp is not None:
        etp = layout.expert_tp
        out.update(ep=layout.ep, etp=etp, edp=world_size // (etp * layout.ep * layout.pp))
    return out


def recompute_label(recompute: Recompute) -> str:
    granularity, method, num_layers = recompute
    if granularity is None:
        return "none"
    return granularity if granularity == "selective" else f"full {method} {num_layers}"


def route_parts(
    result: Plan, hf: HFModelConfig, critic_hf: HFModelConfig | None = None
) -> dict[str, HostPart]:
    """``result``'s ordinary host memory of routing replay per GPU (``route_host_parts``) for
    the policy's model ``hf`` and the critic's ``critic_hf`` (None: the policy's)."""
    models: Models = {"lm": (hf, result.policy)}
    if result.critic is not None:
        models["value"] = (critic_hf or hf, result.critic)
    return route_host_parts(models, result.workload)


def plan_summary(result: Plan, routes: dict[str, HostPart] | None = None) -> dict[str, object]:
    """The JSON the planner prints last: fits, layout, peak and headroom, KV capacity, host
    memory (``routes``: routing replay's, from :func:`route_parts`)."""
    work = result.workload
    layout: dict[str, object] = {"policy": layout_summary(result.policy, work.world_size)}
    if result.critic is not None:
        layout["critic"] = layout_summary(result.critic, work.world_size)
    layout.update(rollout_tp=work.rollout_tp, gpu_memory_utilization=work.gpu_memory_utilization,
                  offload=work.offload, policy_recompute=recompute_label(work.policy_recompute),
                  critic_recompute=recompute_label(work.critic_recompute))  # fmt: skip
    out: dict[str, object] = {"fits": result.fits, "layout": layout, "peak_gib": None}
    if result.phases:
        out.update(
            peak_gib=round(result.peak / GIB, 2),
            headroom_gib=round(result.headroom / GIB, 2),
            kv_sequences_per_replica=round(result.concurrent_sequences, 1),
            # None when the KV cache cannot hold one sequence (the plan lists that problem).
            rollout_seconds_estimated=(
                round(result.rollout_seconds) if math.isfinite(result.rollout_seconds) else None
            ),
            host_gib_per_gpu=round(result.host_bytes / GIB, 2),
            host_gib_per_node=round(result.host_bytes_per_node / GIB, 1),
            pinned_gib_per_gpu={
                name: {"gib": round(part.nbytes / GIB, 2), "label": part.label}
                for name, part in result.pinned.items()
            },
        )
        if routes:
            out["route_host_gib_per_gpu"] = {
                name: {"gib": round(part.nbytes / GIB, 2), "label": part.label}
                for name, part in routes.items()
            }
            out["route_host_peak_gib_per_gpu"] = round(route_host_peak(routes) / GIB, 2)
    out["problems"] = result.problems
    return out


def format_plan(result: Plan, title: str, routes: dict[str, HostPart] | None = None) -> str:
    """A readable table of one plan: layouts, per-GPU memory by kind and by phase, vLLM, host
    memory (``routes``: routing replay's, from :func:`route_parts`); each figure labelled
    exact, measured (on CPU) or estimated."""
    work, gib = result.workload, lambda b: f"{b / GIB:7.2f} GiB"
    lines = [f"== {title}: {'fits' if result.fits else 'DOES NOT FIT'} =="]

    def fmt(layout: ModelLayout) -> str:
        ranks = layout.tp * layout.pp * layout.cp
        dp = work.world_size // ranks if work.world_size % ranks == 0 else "-"
        vpp = f" vpp{layout.vpp}" if layout.vpp else ""
        sp = " sp" if layout.sequence_parallel else ""
        ep = f" ep{layout.ep}" if layout.ep > 1 else ""
        ep += f" etp{layout.etp}" if layout.etp is not None else ""
        return f"tp{layout.tp} pp{layout.pp}{vpp} cp{layout.cp} dp{dp}{ep}{sp}"

    models = [("policy", result.policy, result.policy_memory, work.policy_recompute)]
    if result.critic is not None:
        models.append(("critic", result.critic, result.critic_memory, work.critic_recompute))
    lines.append(f"{'':44}" + "".join(f"{m[0]:>24}" for m in models))
    lines.append(f"{'layout':44}" + "".join(f"{fmt(m[1]):>24}" for m in models))
    lines.append(f"{'recompute':44}" + "".join(f"{recompute_label(m[3]):>24}" for m in models))
    if result.phases:
        shards = "DP x CP" if work.distributed_optimizer else "not sharded"
        if work.distributed_optimizer and any(m[1].ep > 1 for m in models):
            shards += "; experts: expert DP"
        grad = "fp32" if work.grad_reduce_in_fp32 or not work.bf16 else "bf16"
        rows = [("params (bf16) [exact]" if work.bf16 else "params (fp32) [exact]", "params"),
                (f"grads ({grad}) [exact]", "grads"), (f"Adam ({shards}) [exact]", "optimizer"),
                ("activations [estimated; logits measured]", "activations")]  # fmt: skip
        for label, attr in rows:
            cells = "".join(f"{gib(getattr(m[2], attr)):>24}" for m in models)
            lines.append(f"{label:44}{cells}")
        replicas = work.world_size // work.rollout_tp
        lines.append(
            f"vLLM TP {work.rollout_tp} ({replicas} replicas), gpu_memory_utilization "
            f"{work.gpu_memory_utilization:.2f}: weights {gib(result.vllm_weights).strip()} "
            f"[exact], KV cache {gib(result.kv_cache).strip()} per GPU [estimated] = "
            f"{result.concurrent_sequences:.1f} full {work.sequence_len}-token sequences per "
            "replica"
        )
        seconds = result.rollout_seconds
        duration = (
            f"about {seconds / 60:.0f} min per step"
            if math.isfinite(seconds)
            else "never: the KV cache holds less than one sequence"
        )
        lines.append(
            f"rollout of {work.samples_per_step} responses (mean "
            f"{work.mean_response_fraction:.0%} of {work.response_len} tokens): {duration} "
            f"[estimated, planning/vllm.py: decode at {DECODE_EFFICIENCY:.0%} of "
            f"{result.gpu.hbm_bytes_per_s / 1e12:.2f} TB/s or of the bf16 peak, and the "
            "collectives' latency]"
        )
        lines.append(f"offload: {work.offload} ({OFFLOADS[work.offload]})")
        lines.append(
            f"pinned host memory {gib(result.host_bytes).strip()} per GPU, "
            f"{gib(result.host_bytes_per_node).strip()} per {work.gpus_per_node}-GPU node:"
        )
        for name, part in result.pinned.items():
            lines.append(f"  {name:22}{gib(part.nbytes)} [{part.label}] {part.what}")
        if routes:
            lines.append(
                f"routing replay: ordinary host memory (not pinned), at most "
                f"{gib(route_host_peak(routes)).strip()} at once on a rollout replica's first rank:"
            )
            for name, part in routes.items():
                lines.append(f"  {name:22}{gib(part.nbytes)} [{part.label}] {part.what}")
        parts = ", ".join(f"{name} {b / GIB:.2f}" for name, b in result.reserve.items())
        lines.append(f"reserve {gib(sum(result.reserve.values())).strip()} per GPU "
                     f"[estimated: {parts} GiB]")  # fmt: skip
        lines.append(f"per-GPU peak by phase (of {gib(result.gpu.memory_bytes).strip()}):")
        for name, need in result.phases.items():
            free = result.gpu.memory_bytes - need
            lines.append(f"  {name:22}{gib(need)}   headroom {gib(free)}")
    lines += [f"  problem: {p}" for p in result.problems]
    return "\n".join(lines)


def colocated_summary(step: Colocated) -> dict[str, object]:
    """The synchronous step's figures (``planning/placement.py``; estimated)."""
    return {
        "ranks": step.plan.workload.world_size,
        "vllm_layout": step.decode.layout.describe(),
        "kv_sequences_per_replica": round(step.decode.sequences_per_replica, 1),
        "rollout_seconds": _seconds(step.decode.seconds),
        "tail_seconds": round(step.tail_seconds),
        "train_seconds": round(step.train_seconds),
        "switch_seconds": round(step.switch_seconds),
        "step_seconds": _seconds(step.step_seconds),
    }


def separate_summary(
    step: Separate, colocated: Colocated, same_layout: Colocated
) -> dict[str, object]:
    """One split's figures (``planning/placement.py``; estimated) and its step over the
    synchronous one's, as planned and with vLLM laid out as on the rollout ranks."""
    summary = {"rollout.ranks": step.rollout_ranks, "trainer_ranks": step.trainer_ranks}
    summary.update({f"trainer_{k}": v for k, v in layout_summary(
        step.trainer.policy, step.trainer_ranks).items() if k in ("tp", "pp", "cp", "ep")})  # fmt: skip
    if step.trainer.critic is not None:
        critic = layout_summary(step.trainer.critic, step.trainer_ranks)
        summary.update({f"critic_{k}": v for k, v in critic.items() if k in ("tp", "pp", "cp")})
    summary.update(
        trainer_peak_gib=round(step.trainer.peak / GIB, 2),
        vllm_layout=step.decode.layout.describe(),
        rollout_gpu_memory_utilization=step.utilization,
        kv_gib_per_gpu=round(step.decode.kv_cache / GIB, 1),
        kv_sequences_per_replica=round(step.decode.sequences_per_replica, 1),
        rollout_seconds=_seconds(step.decode.seconds),
        tail_seconds=round(step.tail_seconds),
        train_seconds=round(step.train_seconds),
        transfer_seconds=round(step.transfer_seconds),
        wait_seconds=_seconds(step.wait_seconds),
        step_seconds=_seconds(step.step_seconds),
        over_synchronous=round(step.step_seconds / colocated.step_seconds, 2),
        synchronous_same_layout_seconds=_seconds(same_layout.step_seconds),
        over_synchronous_same_layout=round(step.step_seconds / same_layout.step_seconds, 2),
    )
    return summary


def format_placement(colocated: dict[str, object], splits: dict[str, dict[str, object]]) -> str:
    """Readable lines of the placement comparison (the summaries above; every figure
    estimated)."""
    minutes = lambda s: "never" if s is None else f"{s / 60:.1f} min"  # noqa: E731
    c = colocated
    lines = [
        f"placement [estimated; planning/placement.py]: colocated, {c['ranks']} ranks, vLLM "
        f"{c['vllm_layout']} ({c['kv_sequences_per_replica']} sequences per replica): step "
        f"{minutes(c['step_seconds'])} = rollout {minutes(c['rollout_seconds'])} + tail "
        f"{minutes(c['tail_seconds'])} + training {minutes(c['train_seconds'])} + switch "
        f"{minutes(c['switch_seconds'])}"
    ]
    for name, s in splits.items():
        lines.append(
            f"  {name}: {s['rollout.ranks']} rollout ranks (vLLM {s['vllm_layout']}, "
            f"utilization {s['rollout_gpu_memory_utilization']:.2f}, {s['kv_gib_per_gpu']} GiB "
            f"KV per GPU, {s['kv_sequences_per_replica']} sequences per replica) + "
            f"{s['trainer_ranks']} trainer ranks (policy tp{s['trainer_tp']} pp{s['trainer_pp']} "
            f"cp{s['trainer_cp']}, peak {s['trainer_peak_gib']} GiB): step "
            f"{minutes(s['step_seconds'])} = max(training {minutes(s['train_seconds'])}, rollout "
            f"{minutes(s['rollout_seconds'])} + tail {minutes(s['tail_seconds'])}) + transfer "
            f"{minutes(s['transfer_seconds'])}: {s['over_synchronous']} of the synchronous step "
            f"({s['over_synchronous_same_layout']} of a synchronous step with vLLM "
            f"{s['vllm_layout']}: {minutes(s['synchronous_same_layout_seconds'])})"
        )
    return "\n".join(lines)


def _seconds(value: float) -> int | None:
    return round(value) if math.isfinite(value) else None
