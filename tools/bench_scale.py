"""The step's host bookkeeping at the 32B recipe's step shape, on 2 gloo ranks.

Runs the trainer's own ``run_step`` (rollout gather and filtering, the scoring passes' packing,
GAE, the routed advantages, mini-batch packing, normalisers, metrics) with the model compute
stubbed:
generation returns synthetic responses of the recipe's length distribution (lognormal, capped
at max_new_tokens; ~300-token prompts), grading is a constant-time stub, the scoring pass
returns deterministic values, the updates do no arithmetic and weight sync is skipped. Two
ranks form two rollout replicas; both models DP2 (one layout: nothing per token crosses
ranks), or with ``--mixed`` the policy TP2 (DP1) and the critic DP2, as a smaller critic next to
a larger policy splits the ranks: GAE runs on the critic's DP ranks and each token's advantage
goes to both policy TP ranks over the host group (``step/advantage_exchange.py``;
``python tools/bench_scale.py 2048 mixed``).

Bookkeeping seconds = step time - generation - grading - sync - the model stub's own time
(``time/megatron``, as the trainer reports its schedule's compute), for the slowest rank of
each step; the best of steps 2-4 is reported (the first pays one-time costs, the spread of the
others is the shared machine's noise, printed too). The bench runs SAMPLES per step (default
8,192: the 32B step itself, ~45 s; ``--quick`` 256); a smaller SAMPLES is extrapolated linearly
to 8,192, and peak host memory per rank (ru_maxrss, over all steps) as the baseline after
start-up plus the growth times 8,192 / samples. The default measures the full step because
a linear extrapolation misses what does not scale linearly: a rank's whole-step arrays are
~40 MB at 2,048 samples and ~170 MB at 8,192, each a fresh mapping every step whose pages the
kernel zeroes and faults in again (2 MiB at a time with the ranks' huge-page tunable,
``launch/host_malloc.py``), and the host collectives' latency is per call, not per sample
(docs/benchmarks.md). Each rank also reports its CPU and system seconds and page faults per
step. The workers start as the trainer's ranks do (``run_local_ranks``: glibc's huge-page
tunable; ``GLIBC_TUNABLES=glibc.malloc.hugetlb=0`` turns it off, for an A/B) and set glibc's
malloc as they do (``launch/host_malloc.py``; ``BENCH_SCALE_MALLOC=default`` keeps glibc's
defaults); ``BENCH_SCALE_PROFILE=PREFIX`` writes a cProfile of each rank's last step (CPU
clock) to ``PREFIX.RANK``.
"""

from __future__ import annotations

import cProfile
import json
import os
import resource
import sys
import tempfile
import time
from array import array
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
STEP_SAMPLES = 8192


def bench_steps() -> int:
    """Steps run (``BENCH_SCALE_STEPS``, default 4, at least 2); the first pays one-time costs,
    the best of the others is reported. Each rank's peak memory is printed after every step: a
    run of more steps shows whether it keeps growing (as a fragmenting heap's did:
    docs/benchmarks.md)."""
    steps = os.environ.get("BENCH_SCALE_STEPS", "4")
    if not steps.isdigit() or int(steps) < 2:
        raise SystemExit(f"BENCH_SCALE_STEPS={steps!r}: give a whole number of steps, at least 2")
    return int(steps)


PROMPT_TOKENS = 300


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


PHASES = ("rollout_other", "scoring", "advantages", "update_critic", "update_policy", "route")
"""The step's own phases (time/<phase>), printed per rank; route: the routed advantages'
all-to-alls (part of scoring and advantages)."""


class StubRollout:
    """Synthetic generation of the recipe's lengths (capped at ``max_new``); odd samples are
    correct. Outputs as ``RolloutEngine.generate`` hands them (``array('i')`` ids,
    ``array('f')`` log-probs)."""

    def __init__(self, max_new: int) -> None:
        self.max_new = max_new
        self.state = SimpleNamespace(asleep=False)

    def generate(self, prompt_ids, *, n, seed, **_):
        from bench_gae import response_lengths

        lengths = response_lengths(len(prompt_ids) * n, seed=seed).clamp(max=self.max_new)
        out = []
        for i, length in enumerate(lengths.tolist()):
            out.append(
                SimpleNamespace(
                    prompt_index=i // n, response_token_ids=array("i", range(1, length + 1)),
                    logprobs=array("f", [-0.5]) * length,
                    finish_reason="length" if length == self.max_new else "stop",
                )
            )  # fmt: skip
        return out

    def wake_up(self, tags):
        pass

    def sleep(self):
        pass


def stub_grade(items, routing, *, timeout_s):
    """Constant-time grades: odd samples correct (+1), even ones wrong (-1)."""
    results = [
        SimpleNamespace(score=float(i % 2) * 2 - 1, acc=float(i % 2)) for i in range(len(items))
    ]
    return results, SimpleNamespace(num_errors=0, num_timeouts=0)


class StubEngine:
    """A ModelEngine with the model stubbed, no arithmetic: DP over the world's ranks, or
    (``tp2``) TP over them (both ranks hold every sample, DP1)."""

    def __init__(self, host, *, tp2: bool = False, singles=None) -> None:
        import torch.distributed as dist

        from vapo_megatron.config.layout import ModelLayout
        from vapo_megatron.parallel.devices import HOST

        rank, world = dist.get_rank(), dist.get_world_size()
        tp = world if tp2 else 1
        self.layout, self.device = ModelLayout(tp=tp), HOST
        self.dp_size, self.dp_rank = world // tp, 0 if tp2 else rank
        self.cp_rank, self.tp_rank = 0, rank if tp2 else 0
        self.is_last_stage, self.vocab_slice, self.compute_seconds = True, None, 0.0
        self.router_replay = None  # a dense model: no routing replay
        self.mtp_loss_weight = 0.0  # no multi-token-prediction layers built
        dp_cp = singles[rank] if tp2 else dist.group.WORLD  # TP2: each rank its own DP group
        self.groups = SimpleNamespace(
            world=dist.group.WORLD, host=host, parallel=SimpleNamespace(dp_cp=dp_cp, cp=None),
            tp_rank=self.tp_rank, pp_rank=0, cp_rank=0, dp_rank=self.dp_rank, tp_size=tp,
            pp_size=1, cp_size=1,
        )  # fmt: skip

    def run(self, mbs, loss_fn, *, forward_only=False, record_routes=False):
        import torch

        from vapo_megatron.parallel.devices import HOST

        # Stands for the model's forward (and backward): its time is the model's, counted
        # in compute_seconds as ModelEngine counts its schedule's (time/megatron).
        start = time.perf_counter()
        if forward_only:  # deterministic outputs from the tokens: log-probs and values
            out = [
                {"logprobs": mb.tokens.float() * -1e-6, "values": mb.tokens.float() * 1e-6}
                for mb in mbs
            ]
        else:
            out = [{"loss_share": torch.zeros((), device=HOST)} for _ in mbs]
        self.compute_seconds += time.perf_counter() - start
        return out

    def step(self):
        return {}


def stub_session(samples: int, mixed: bool, host, run_dir: Path):
    """The ``StepContext`` ``run_step`` takes: the 32B recipe at ``samples`` per step, the stubs
    above (``mixed``: the policy TP2, the critic DP2), synthetic ~300-token prompts."""
    import torch.distributed as dist

    from vapo_megatron.config.recipe import load_recipe
    from vapo_megatron.step.context import StepContext

    n = 16
    config = load_recipe(
        REPO / "recipes" / "vapo_qwen2.5_32b.yaml",
        [f"algorithm.prompts_per_step={samples // n}",
         f"trainer.mini_batch_size={samples // 16}"],  # 16 mini-batches, as at 8,192 samples
    )  # fmt: skip
    prompts = [
        SimpleNamespace(
            token_ids=[(7 * g + k) % 50_000 + 1 for k in range(PROMPT_TOKENS + g % 64)],
            record=SimpleNamespace(index=g, data_source="math", answer="1"),
        )
        for g in range(samples // n)
    ]
    rank, world = dist.get_rank(), dist.get_world_size()
    singles = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
    return StepContext(
        config=config, policy=StubEngine(host, tp2=mixed, singles=singles),
        critic=StubEngine(host),
        rollout=StubRollout(config.rollout.max_new_tokens), weights_current=True,
        sampler=SimpleNamespace(next_indices=lambda count: list(range(count))),
        train_prompts=prompts,
        tokenizer=SimpleNamespace(decode=lambda ids, skip_special_tokens: ""),
        stop_token_ids=[0], routing={}, replica=rank, num_replicas=world, host_group=host,
        rank=rank, run_dir=run_dir,
    )  # fmt: skip


def step_row(metrics: dict[str, float]) -> dict[str, float]:
    """One step's bookkeeping seconds (the step less generation, grading, sync and the model
    stub's own time) and its phases' seconds."""
    excluded = sum(metrics.get(f"time/{p}", 0.0) for p in ("rollout", "reward", "sync", "megatron"))
    phases = {p: round(metrics[f"time/{p}"], 3) for p in PHASES if p != "route"}
    return {"bookkeeping_s": metrics["time/step"] - excluded, **phases}


def time_the_exchange() -> dict[str, float]:
    """Wraps ``AdvantageExchange`` (the routed path's only per-token traffic: the positions
    when it is made, the values in ``send``) to add its seconds and the tokens this rank
    sends to other ranks to the returned dict (reset per step by the caller)."""
    from vapo_megatron.step import advantage_exchange

    spent = {"route": 0.0, "routed_tokens": 0.0}
    cls = advantage_exchange.AdvantageExchange
    make, send = cls.__init__, cls.send

    def timed_init(self, *args, **kwargs):
        start = time.perf_counter()
        make(self, *args, **kwargs)
        spent["route"] += time.perf_counter() - start
        spent["routed_tokens"] += self.sent_elsewhere

    def timed_send(self, *args, **kwargs):
        start = time.perf_counter()
        out = send(self, *args, **kwargs)
        spent["route"] += time.perf_counter() - start
        return out

    cls.__init__, cls.send = timed_init, timed_send
    return spent


def worker(samples: int, steps: int, mixed: bool) -> None:
    import torch
    import torch.distributed as dist

    from vapo_megatron.launch.host_malloc import keep_freed_heap
    from vapo_megatron.parallel.collectives import make_host_group
    from vapo_megatron.step import rollout, run

    if os.environ.get("BENCH_SCALE_MALLOC") != "default":  # as the trainer's ranks run
        keep_freed_heap()
    sys.path.insert(0, str(REPO / "tools"))  # bench_gae, for the response lengths
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    host = make_host_group()
    # The step saves its rollouts under run_dir: removed when this worker ends.
    run_dir = tempfile.TemporaryDirectory(prefix="bench_scale_")
    session = stub_session(samples, mixed, host, Path(run_dir.name))
    rollout.score_responses = stub_grade  # the grader is not the data path
    run.sync_weights = lambda session: {}  # nor is the weight stream (tools/bench.py sync)
    spent = time_the_exchange()
    profile = os.environ.get("BENCH_SCALE_PROFILE")  # a path prefix: pstats of the last step
    dist.barrier(host)
    base_gb = rss_gb()
    rows = []
    for k in range(steps):
        spent.update(route=0.0, routed_tokens=0.0)
        cpu, usage = time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        if profile and k == steps - 1:  # the last step, on a CPU-time clock
            profiler = cProfile.Profile(time.process_time)
            metrics = profiler.runcall(run.run_step, session, k, pretrain=False)
            profiler.dump_stats(f"{profile}.{dist.get_rank()}")
        else:
            metrics = run.run_step(session, k, pretrain=False)
        cpu = time.process_time() - cpu - metrics.get("time/megatron", 0.0)
        after = resource.getrusage(resource.RUSAGE_SELF)
        faults, sys_s = after.ru_minflt - usage.ru_minflt, after.ru_stime - usage.ru_stime
        rows.append({**step_row(metrics), **spent, "cpu_s": cpu, "faults": faults, "sys_s": sys_s,
                     "peak_gb": rss_gb()})  # fmt: skip
    result = {
        "rank": dist.get_rank(), "samples": int(metrics["num_samples"]),
        "response_tokens": int(metrics["response_length/mean"] * metrics["num_samples"]),
        "base_gb": base_gb, "peak_gb": rss_gb(), "steps": rows,
        "path": session.data_path,
    }  # fmt: skip
    print("SCALE_RESULT " + json.dumps(result), flush=True)
    run_dir.cleanup()
    dist.destroy_process_group()


def run(quick: bool = False, samples: int | None = None, mixed: bool = False) -> None:
    """``mixed``: the policy TP2 x the critic DP2 (the routed path) instead of both DP2 (one
    layout: the shard path)."""
    from vapo_megatron.launch.local_launch import run_local_ranks

    steps = bench_steps()
    samples = samples or (256 if quick else STEP_SAMPLES)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONWARNINGS"] = "ignore"
    command = [sys.executable, __file__, "--worker", str(samples), str(steps), str(int(mixed))]
    start = time.perf_counter()
    outputs = run_local_ranks(command, 2, timeout=1800, env=env, cwd=REPO)
    wall = time.perf_counter() - start
    results = [
        json.loads(line.split("SCALE_RESULT ", 1)[1])
        for out in outputs
        for line in out.splitlines()
        if line.startswith("SCALE_RESULT ")
    ]
    if len(results) != 2:
        raise RuntimeError("bench scale: a rank gave no result:\n" + "\n".join(outputs))
    scale = STEP_SAMPLES / results[0]["samples"]
    phases = PHASES
    # A step takes as long as its slowest rank; the best of the steps after the first (which
    # pays one-time costs) is the code's cost, the others add the shared machine's noise.
    per_step = [max(r["steps"][k]["bookkeeping_s"] for r in results) for k in range(steps)]
    layouts = "policy TP2 x critic DP2" if mixed else "DP2 both"
    path = results[0]["path"]
    best = min(range(1, steps), key=per_step.__getitem__)
    print(f"{samples} samples per step, {results[0]['response_tokens']:,} response tokens, "
          f"2 gloo ranks ({layouts}), {path} path; steps 2-{steps} took "
          + ", ".join(f"{t:.2f}" for t in per_step[1:])
          + f" s, best is step {best + 1}; wall {wall:.0f} s")  # fmt: skip
    print(
        f"{'rank':>4} {'bookkeep s':>10} "
        + " ".join(f"{p:>13}" for p in phases)
        + f" {'peak GB':>8}"
    )
    for r in results:
        row = r["steps"][best]
        print(f"{r['rank']:>4} {row['bookkeeping_s']:10.2f} "
              + " ".join(f"{row[p]:13.2f}" for p in phases) + f" {r['peak_gb']:8.2f}")  # fmt: skip
    seconds = per_step[best] * scale
    host_gb = max(r["base_gb"] + (r["peak_gb"] - r["base_gb"]) * scale for r in results)
    route_s = max(r["steps"][best]["route"] for r in results) * scale
    routed = sum(r["steps"][best]["routed_tokens"] for r in results) * scale
    cpu = [[r["steps"][k]["cpu_s"] for k in range(1, steps)] for r in results]
    print("CPU s per step and rank (the stubbed generation included; steps 2-"
          f"{steps}): " + "; ".join(" ".join(f"{c:.2f}" for c in row) for row in cpu))  # fmt: skip
    faults = [[r["steps"][k]["faults"] / 1000 for k in range(1, steps)] for r in results]
    sys_s = [[r["steps"][k]["sys_s"] for k in range(1, steps)] for r in results]
    print("of which system (the kernel, mostly zeroing fresh pages) and thousands of page "
          "faults: " + "; ".join(" ".join(f"{c:.2f}" for c in row) for row in sys_s)
          + " s; " + "; ".join(" ".join(f"{c:.0f}k" for c in row) for row in faults))  # fmt: skip
    peaks = [[r["steps"][k]["peak_gb"] for k in range(steps)] for r in results]
    print("peak host GB per rank after each step: "
          + "; ".join(" ".join(f"{g:.2f}" for g in row) for row in peaks))  # fmt: skip
    print(f"routed advantages: {routed:,.0f} tokens to another rank, {route_s:.2f} s (in the "
          "phases above)")  # fmt: skip
    print(f"extrapolated to {STEP_SAMPLES} samples (x{scale:g}): {seconds:.1f} s per step, "
          f"{host_gb:.2f} GB host per rank (targets: <= 5 s, <= 2 GB)")  # fmt: skip
    print(
        json.dumps(
            {
                "bench": "scale",
                "bookkeeping_s_per_step": round(seconds, 2),
                "host_gb_per_rank": round(host_gb, 2),
                "samples": STEP_SAMPLES,
                "response_tokens": round(results[0]["response_tokens"] * scale),
                "measured_samples": results[0]["samples"],
                "path": path,
                "mixed": mixed,
                "route_s_per_step": round(route_s, 2),
                "routed_tokens": round(routed),
                "steps_s": [round(t * scale, 2) for t in per_step[1:]],
            }
        )
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), bool(int(sys.argv[4])))
    else:
        run(
            samples=int(sys.argv[1]) if len(sys.argv) > 1 else None,
            mixed=len(sys.argv) > 2 and sys.argv[2] == "mixed",
        )
