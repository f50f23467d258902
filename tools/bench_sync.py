"""Weight-sync benchmark: a Megatron policy at TP=2 streamed into vLLM CPU engine replicas.

Two ranks hold a synthetic Qwen2-shaped policy (~310 MB in fp32) at Megatron TP=2 and host
vLLM engines inside the job (external_launcher): at vLLM TP=1 one replica per rank, at vLLM
TP=2 one replica over both ranks. The sync (TP gather -> HF tensors -> messages -> engine) runs
on both ranks at once. From the same run, best of 3 each:

- transport: the same bytes through the same collectives (the stream's own all-gathers, one
  ``all_gather_into_tensor`` per piece ``gather_pieces`` names, in the stream's order, into
  preallocated buffers), nothing else: the floor for any sync on this machine;
- stream: the weight stream alone (gathers + conversion to HF tensors, fresh buffers);
- engine: the engine's load alone, from HF tensors already in memory;
- sync: ``push_policy_weights`` as the trainer runs it (step/weight_sync.py: the stream's plan,
  a pool of gather buffers of its own, serial on CPU), split into the time inside the
  engine's loaders and the time producing the stream; the same with the stream produced one
  message ahead in a thread (``prefetch=True``); with one pool kept across syncs (warm
  buffers); and as it was before the plan (fresh buffers, no plan);
- memcpy: ``Tensor.copy_`` of the model's HF tensors (the same bytes) on both ranks at once.

Each timed path also reports the CPU time of the rank's process (all its threads) over the
wall time: near 1.0 a rank's core was busy throughout (1 thread per rank on 2 cores), and
overlap cannot gain; from these, the best fraction any overlap could reach with one core per
rank. Peak extra memory of a sync per rank: VmHWM during one sync minus VmRSS before it, in
bytes and in buckets (``bucket_bytes``, the bound on weight bytes in flight), with the pool
the trainer keeps between syncs named apart; the main topology is launched once more under a
fixed glibc mmap threshold, whose peaks count the data alive at once rather than what glibc
keeps resident after frees.

``fraction_of_transport = transport_seconds / sync_seconds`` is our overhead over the
transport (target >= 0.8); ``fraction_of_memcpy = memcpy_seconds / sync_seconds``. The
projection for Qwen2.5-32B on H100s prints its assumptions.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

WORKER_FLAG = "--bench-sync-worker"
CONFIG = dict(
    hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
    intermediate_size=2816, num_hidden_layers=4, vocab_size=16000,
    max_position_embeddings=512, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
)  # fmt: skip
QUICK = dict(
    CONFIG,
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=512,
    num_hidden_layers=2,
    vocab_size=4096,
)  # head_dim 64 = hidden / heads: vLLM's CPU attention needs one it supports
BUCKET_BYTES = 64 << 20
# glibc raises its mmap threshold (up to 32 MB) as large blocks are freed, after which freed
# blocks stay in its heaps: resident, reused later, and counted by VmHWM. A fixed threshold
# returns them at once, so a peak measured under it is the data alive at once.
LIVE_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
ENGINE_TPS = (1, 2)
QWEN32B = dict(hidden=5120, heads=40, kv_heads=8, head_dim=128, ffn=27648, layers=64, vocab=152064)
H100_HBM_COPY_GBPS = 1500.0  # device-to-device copy, read + write counted once (3 TB/s moved)
H100_NVLINK_GBPS = 450.0  # per direction, NVLink 4
H100_TP = 8  # Megatron TP = vLLM TP = 8: one engine replica per node


def best_of_each(paths: dict, repeats: int = 3) -> dict:
    """{name: (seconds, result, cpu share)} of the fastest of ``repeats`` runs of each path,
    the paths taken in turn (A B C A B C ...) so that none gains from running after the others
    (glibc's heap warmed by earlier paths made a later one up to ~15% faster); every rank timed
    between barriers; cpu share: this process's CPU seconds (all threads) over the wall seconds."""
    best = {}
    for _ in range(repeats):
        for name, fn in paths.items():
            torch.distributed.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            result = fn()
            cpu = time.process_time() - cpu
            seconds = time.perf_counter() - start
            torch.distributed.barrier()
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, result, cpu / seconds)
    return best


def transport_plan(engine, tp_group):
    """(local shard, gather buffer) of every tensor the stream all-gathers, in its order."""
    import torch.distributed as dist

    from vapo_megatron.weights.gather import gather_pieces, tp_gathers

    tp = dist.get_world_size(tp_group)
    plan = []
    for _, m, local, _ in tp_gathers(engine.chunks, engine.record, engine.config, pp_rank=0):
        for piece in gather_pieces(m, local, tp):
            plan.append((piece, piece.new_empty((tp * piece.shape[0], *piece.shape[1:]))))
    return plan


def sync_peak(rollout, sync) -> int:
    """Peak extra resident memory of this rank over one ``sync()``, in bytes."""
    rss_before = rollout.reset_peak_memory()[0]
    sync()
    return rollout.peak_memory()[0] - rss_before


def build(hf_dir: str, engine_tp: int, quick: bool):
    """(HF tensors, Megatron policy at TP=2, this rank's engine replica, its start seconds): a
    synthetic Qwen2 policy, saved to ``hf_dir`` for the engines to start from."""
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from vapo_megatron.config.layout import ModelLayout
    from vapo_megatron.config.optim import OptimSettings
    from vapo_megatron.engine.model_engine import ModelEngine
    from vapo_megatron.models.config import HFModelConfig
    from vapo_megatron.parallel.cpu_shim import initialize_megatron_cpu
    from vapo_megatron.rollout.engine import RolloutConfig, RolloutEngine

    initialize_megatron_cpu(tp=2)
    config = Qwen2Config(**(QUICK if quick else CONFIG))
    torch.manual_seed(0)
    state = {k: v.contiguous() for k, v in Qwen2ForCausalLM(config).float().state_dict().items()}
    if dist.get_rank() == 0:
        Qwen2ForCausalLM(config).save_pretrained(hf_dir)
    dist.barrier()
    hf = HFModelConfig.from_hf(config.to_dict())
    engine = ModelEngine(hf, ModelLayout(tp=2), head="lm", optim=OptimSettings())
    engine.load_hf(state)
    start = time.perf_counter()
    rollout = RolloutEngine(
        RolloutConfig(
            model_path=hf_dir, dtype="float32", max_model_len=256, tensor_parallel_size=engine_tp,
            kv_cache_bytes=64 << 20, seed=dist.get_rank() // engine_tp,
        )
    )  # fmt: skip
    return state, engine, rollout, time.perf_counter() - start


def sync_paths(engine, rollout, kept) -> dict:
    """The syncs timed and measured for memory: as the trainer runs it (step/weight_sync.py: the
    stream's plan, a pool of gather buffers of its own, serial on CPU), with one pool ``kept``
    across syncs, and without the plan (as before it; gate/up already gathered apart)."""
    from vapo_megatron.step.weight_sync import push_policy_weights

    def sync(prefetch=None, buffers=None):
        return push_policy_weights(
            engine, rollout, bucket_bytes=BUCKET_BYTES, buffers=buffers, prefetch=prefetch
        )

    def sync_before():  # tensor by tensor, bucketed again without the plan
        from vapo_megatron.weights.buckets import iter_buckets

        tensors = (t for b in stream_alone(engine) for t in b)
        return rollout.update_weights(iter_buckets(tensors, BUCKET_BYTES))

    return {"sync": sync, "sync_kept": lambda: sync(buffers=kept), "sync_before": sync_before}


def stream_alone(engine):
    """The weight stream, consumed by nobody but the caller (fresh buffers)."""
    from megatron.core import parallel_state as ps

    from vapo_megatron.weights.stream import stream_policy_weights

    return stream_policy_weights(
        engine.chunks, engine.record, engine.config,
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(), bucket_bytes=BUCKET_BYTES,
    )  # fmt: skip


def reference_paths(engine, rollout, state, targets) -> tuple[dict, int]:
    """The paths a sync is compared with (memcpy into ``targets``, the transport, the stream
    alone, the engine's load alone) and the bytes the transport all-gathers per rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from vapo_megatron.weights.buckets import iter_buckets

    tp_group = ps.get_tensor_model_parallel_group()
    plan = transport_plan(engine, tp_group)

    def transport():
        for local, full in plan:
            dist.all_gather_into_tensor(full, local, group=tp_group)

    paths = {
        "memcpy": lambda: [targets[k].copy_(v) for k, v in state.items()],
        "transport": transport,
        "stream": lambda: [None for _ in stream_alone(engine)],
        "engine": lambda: rollout.update_weights(iter_buckets(state.items(), BUCKET_BYTES)),
    }
    return paths, sum(full.numel() * full.element_size() for _, full in plan)


def sync_peaks(rollout, syncs: dict) -> dict:
    """{sync: peak extra resident bytes of this rank}, the most of 3 rounds taken in turn (as
    the timings)."""
    peaks = {name: 0 for name in syncs}
    for _ in range(3):
        for name, fn in syncs.items():
            peaks[name] = max(peaks[name], sync_peak(rollout, fn))
    return peaks


def worker(hf_dir: str, engine_tp: int, quick: bool) -> None:
    import torch.distributed as dist

    from vapo_megatron.weights.gather import GatherBuffers

    torch.set_num_threads(1)
    state, engine, rollout, start_s = build(hf_dir, engine_tp, quick)
    kept = GatherBuffers(limit_bytes=BUCKET_BYTES)  # warm buffers kept from one sync to the next
    syncs = sync_paths(engine, rollout, kept)
    targets = {k: torch.empty_like(v) for k, v in state.items()}
    references, transport_bytes = reference_paths(engine, rollout, state, targets)
    prefetch = {"prefetch": lambda: syncs["sync"](prefetch=True)}
    timed = best_of_each({**references, **prefetch, **syncs})
    targets.clear()
    peaks = sync_peaks(rollout, syncs)
    # The synced engine must hold the Megatron weights: it generates after the sync.
    rollout.generate([[1, 2, 3]], n=1, temperature=0.0, max_new_tokens=2)
    per_rank = [None] * dist.get_world_size()
    mine = dict(
        peak=peaks["sync"], peak_kept=peaks["sync_kept"], peak_before=peaks["sync_before"],
        kept=kept.nbytes(), cpu={k: v[2] for k, v in timed.items()},
    )  # fmt: skip
    dist.all_gather_object(per_rank, mine)
    if dist.get_rank() == 0:
        total_bytes = sum(t.numel() * t.element_size() for t in state.values())
        sizes = dict(engine_tp=engine_tp, bytes=total_bytes, transport_bytes=transport_bytes)
        print("RESULT " + json.dumps(result_row(sizes, start_s, timed, per_rank)))
    dist.barrier()
    rollout.shutdown()


def result_row(sizes: dict, start_s: float, timed: dict, per_rank: list[dict]) -> dict:
    """Rank 0's RESULT line: sizes, times, and every rank's peaks and CPU shares."""
    stats = timed["sync"][1]
    return dict(
        **sizes, start_s=start_s, bucket_bytes=BUCKET_BYTES, num_buckets=stats.num_buckets,
        sync_load_s=stats.load_seconds, sync_wait_s=stats.wait_seconds,
        peak_extra_bytes=[r["peak"] for r in per_rank], cpu=[r["cpu"] for r in per_rank],
        peak_kept_bytes=[r["peak_kept"] for r in per_rank],
        peak_before_bytes=[r["peak_before"] for r in per_rank],
        kept_bytes=[r["kept"] for r in per_rank],
        load_average=os.getloadavg()[0],
        **{f"{k}_s": v[0] for k, v in timed.items()},
    )  # fmt: skip


def launch(engine_tp: int, quick: bool, extra_env: dict[str, str] | None = None) -> dict:
    from vapo_megatron.launch.local_launch import run_local_ranks

    repo = Path(__file__).resolve().parents[1]
    env = dict(
        os.environ,
        PYTHONPATH=str(repo),
        PYTHONWARNINGS="ignore",
        VLLM_LOGGING_LEVEL="ERROR",
        **(extra_env or {}),
    )
    with tempfile.TemporaryDirectory() as hf_dir:
        command = [sys.executable, __file__, WORKER_FLAG, hf_dir, str(engine_tp), str(int(quick))]
        outputs = run_local_ranks(command, 2, timeout=1800, env=env, cwd=repo)
    line = next(ln for ln in outputs[0].splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def one_core_bound(r: dict) -> float:
    """The best fraction_of_transport any overlap could reach with one core per rank: a sync
    does at least the transport's and the engine's CPU work, on the rank's one core, and
    lasts at least as long as the transport (CPU seconds from this run, the busier rank)."""
    work = max(r["transport_s"] * c["transport"] + r["engine_s"] * c["engine"] for c in r["cpu"])
    return r["transport_s"] / max(r["transport_s"], work)


def report(r: dict) -> None:
    gb = r["bytes"] / 1e9
    tp = r["engine_tp"]
    topology = "one replica per rank" if tp == 1 else f"one replica over {tp} ranks"
    print(
        f"\nvLLM TP={tp} ({topology}, external_launcher, up in {r['start_s']:.1f} s): "
        f"{gb * 1e3:.0f} MB fp32 from Megatron TP=2, bucket {BUCKET_BYTES >> 20} MB "
        f"({r['num_buckets']} messages), both ranks at once"
    )
    print(
        f"{'path':>50} {'seconds':>8} {'GB/s':>7} {'of memcpy':>10} {'of sync':>8} "
        f"{'CPU/wall per rank':>18}"
    )
    rows = [
        ("memcpy of the same bytes", "memcpy"),
        (f"transport ({r['transport_bytes'] / 1e6:.0f} MB all-gathered/rank)", "transport"),
        ("stream alone (gather + conversion, fresh buffers)", "stream"),
        ("engine load alone (HF tensors)", "engine"),
        ("sync as the trainer runs it (serial on CPU)", "sync"),
        ("  of which inside the engine's loaders", "sync_load"),
        ("  of which producing the stream", "sync_wait"),
        ("sync, stream one message ahead (prefetch)", "prefetch"),
        ("sync, one pool kept across syncs", "sync_kept"),
        ("sync without the plan (before)", "sync_before"),
    ]
    for name, key in rows:
        seconds = r[f"{key}_s"]
        cpu = " ".join(f"{c[key]:.2f}" for c in r["cpu"]) if key in r["cpu"][0] else ""
        print(
            f"{name:>50} {seconds:8.3f} {gb / seconds:7.2f} {r['memcpy_s'] / seconds:10.3f} "
            f"{seconds / r['sync_s']:8.3f} {cpu:>18}"
        )
    print(
        f"fraction_of_transport {r['transport_s'] / r['sync_s']:.3f} (with prefetch: "
        f"{r['transport_s'] / r['prefetch_s']:.3f}; pool kept: "
        f"{r['transport_s'] / r['sync_kept_s']:.3f}; before: "
        f"{r['transport_s'] / r['sync_before_s']:.3f}); best any overlap could reach with one "
        f"core per rank: {one_core_bound(r):.3f}; load average {r['load_average']:.1f}"
    )

    print(memory_lines(r))


def in_buckets(values: list[int], bucket_bytes: int) -> str:
    return ", ".join(f"{v / 1e6:.0f} MB = {v / bucket_bytes:.2f} buckets" for v in values)


def memory_lines(r: dict) -> str:
    """Peak extra memory of a sync per rank, for the trainer's way and the two others."""
    b = r["bucket_bytes"]
    kept = ", ".join(f"{k / 1e6:.0f} MB" for k in r["kept_bytes"])
    return (
        f"peak extra memory of a sync per rank, as the trainer runs it: "
        f"{in_buckets(r['peak_extra_bytes'], b)}\n"
        f"  one pool kept across syncs: {in_buckets(r['peak_kept_bytes'], b)}, plus the pool "
        f"held between syncs: {kept}\n"
        f"  without the plan (before): {in_buckets(r['peak_before_bytes'], b)}"
    )


def qwen32b_bytes() -> tuple[float, float]:
    """(all bytes, bytes the stream copies to build HF tensors) of Qwen2.5-32B in bf16 (untied
    embeddings, QKV bias): q/k/v and the row-parallel o_proj and down_proj are copied; the
    embedding and LM head are views, gate/up are gathered straight into their HF tensors, the
    norms are the parameters."""
    c = QWEN32B
    q, kv = c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    qkv = (q + 2 * kv) * (c["hidden"] + 1)
    copied = qkv + q * c["hidden"] + c["ffn"] * c["hidden"]  # + o_proj + down_proj
    layer = copied + 2 * c["ffn"] * c["hidden"] + 2 * c["hidden"]  # + gate/up + norms
    total = c["layers"] * layer + 2 * c["vocab"] * c["hidden"] + c["hidden"]
    return 2.0 * total, 2.0 * c["layers"] * copied


def projection(r: dict) -> None:
    """Qwen2.5-32B bf16 on one 8-H100 node: Megatron TP=8 and one vLLM TP=8 replica."""
    model_bytes, copied_bytes = qwen32b_bytes()
    gather_s = model_bytes * (H100_TP - 1) / H100_TP / (H100_NVLINK_GBPS * 1e9)
    convert_s = copied_bytes / (H100_HBM_COPY_GBPS * 1e9)
    # The engine keeps its 1/TP slice of each tensor; per kept byte it is as slow relative to
    # a memcpy as measured here (CPU: dominated by oneDNN repacking, absent on GPU: pessimistic).
    per_kept_byte = (r["memcpy_s"] / r["engine_tp"]) / r["sync_load_s"]
    engine_s = model_bytes / H100_TP / (per_kept_byte * H100_HBM_COPY_GBPS * 1e9)
    serial = gather_s + convert_s + engine_s
    # Prefetch: the engine loads message k while message k+1 is gathered (NCCL on its own
    # stream), so at best the sync lasts as long as the longer of the two.
    overlapped = max(gather_s + convert_s, engine_s)
    print(
        f"\nprojection, Qwen2.5-32B bf16 ({model_bytes / 1e9:.1f} GB) on 8 H100s, Megatron "
        f"TP=8 -> one vLLM TP=8 replica in the same ranks, every rank receiving the full model "
        f"in process: all-gather {gather_s:.3f} s (7/8 of the bytes at {H100_NVLINK_GBPS:.0f} "
        f"GB/s NVLink per direction) + conversion {convert_s:.3f} s (the "
        f"{copied_bytes / model_bytes:.0%} of the bytes the stream copies, at "
        f"{H100_HBM_COPY_GBPS:.0f} GB/s) + engine {engine_s:.3f} s (1/8 slice at "
        f"{per_kept_byte:.2f} x HBM copy, the CPU engine's measured rate per kept byte) = "
        f"{serial:.2f} s per sync serial, fraction_of_transport {gather_s / serial:.2f}; with "
        f"prefetch at best {overlapped:.2f} s, fraction {gather_s / overlapped:.2f}; not "
        "measured on a GPU"
    )


def run(quick: bool = False) -> None:
    results = [launch(tp, quick) for tp in ENGINE_TPS]
    for r in results:
        report(r)
    main = results[-1]  # the replicas-of-TP-k topology the trainer uses at scale
    live = launch(main["engine_tp"], quick, LIVE_MEMORY_ENV)
    print(
        f"\nvLLM TP={main['engine_tp']} again with {LIVE_MEMORY_ENV} (freed blocks >= 1 MB go "
        "back to the OS at once, so the peaks count live data, not glibc's retained heap; sync "
        f"{live['sync_s']:.3f} s, transport {live['transport_s']:.3f} s):\n" + memory_lines(live)
    )
    projection(main)
    gb = main["bytes"] / 1e9
    print(
        json.dumps(
            {
                "bench": "sync",
                "engine_tp": main["engine_tp"],
                "gbps": round(gb / main["sync_s"], 3),
                "fraction_of_transport": round(main["transport_s"] / main["sync_s"], 3),
                "fraction_of_memcpy": round(main["memcpy_s"] / main["sync_s"], 3),
                "fraction_bound_one_core": round(one_core_bound(main), 3),
                "peak_extra_buckets": round(
                    max(main["peak_extra_bytes"]) / main["bucket_bytes"], 2
                ),
                "peak_live_buckets": round(max(live["peak_extra_bytes"]) / live["bucket_bytes"], 2),
                "peak_live_before_buckets": round(
                    max(live["peak_before_bytes"]) / live["bucket_bytes"], 2
                ),
            }
        )
    )


if __name__ == "__main__":
    if len(sys.argv) > 4 and sys.argv[1] == WORKER_FLAG:
        worker(sys.argv[2], int(sys.argv[3]), bool(int(sys.argv[4])))
    else:
        run()
