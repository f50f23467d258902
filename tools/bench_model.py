"""Model benchmark: forward + backward tokens/s of the policy, packed vs padded, TP 1 and 2.

A batch of sequences of mixed lengths goes through ``ModelEngine.run`` with the VAPO policy
loss, once right-padded into rows and once packed (THD, no padding between sequences), in the
same micro-batches. Throughput counts *real* tokens only, so padding shows up as lost speed.
The useful-token fraction is real tokens / tokens the model computed on.

On a GPU (``--gpu``), the same measurement with a ~1B-parameter Qwen2-shaped model in bf16
reports model TFLOP/s and MFU against 989 dense bf16 TFLOP/s (H100/H200 SXM).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

WORKER_FLAG = "--bench-model-worker"
H100_BF16_TFLOPS = 989.0


def _model_config(gpu: bool) -> dict:
    if gpu:  # ~1.1B parameters
        return dict(
            hidden_size=2048, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
            intermediate_size=5632, num_hidden_layers=16, vocab_size=32000,
            max_position_embeddings=8192, rope_theta=1e6, rms_norm_eps=1e-6,
        )  # fmt: skip
    return dict(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        intermediate_size=512, num_hidden_layers=4, vocab_size=1024,
        max_position_embeddings=1024, rope_theta=1e6, rms_norm_eps=1e-6,
    )  # fmt: skip


def _samples(gpu: bool, seed: int = 0):
    from vapo_megatron.data.packing import Sample

    gen = torch.Generator().manual_seed(seed)
    count, (lo, hi) = (32, (128, 2048)) if gpu else (16, (16, 224))
    samples = []
    for _ in range(count):
        n_prompt = int(torch.randint(8, 32, (), generator=gen))
        n_resp = int(torch.randint(lo, hi, (), generator=gen))
        fields = {
            "old_logprobs": -torch.rand(n_resp, generator=gen),
            "advantages": torch.randn(n_resp, generator=gen),
            "positive": torch.ones(n_resp, dtype=torch.bool),
        }
        samples.append(
            Sample(
                [1] * n_prompt, torch.randint(0, 1000, (n_resp,), generator=gen).tolist(), fields
            )
        )
    return samples


def _flops_per_token(cfg: dict, seq_len: float) -> float:
    """Forward + backward FLOPs per token: 6 x matmul parameters + causal attention scores."""
    h, layers, ffn = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * ffn
    params = layers * per_layer + h * cfg["vocab_size"]
    attention = layers * 2 * 2 * q * seq_len / 2  # QK^T and AV, causal half
    return 6 * params + 3 * attention


def worker(gpu: bool) -> None:
    from vapo_megatron.algorithms.presets import algo_preset
    from vapo_megatron.config.layout import ModelLayout
    from vapo_megatron.config.optim import OptimSettings
    from vapo_megatron.data.packing import pack, pad
    from vapo_megatron.engine.model_engine import ModelEngine
    from vapo_megatron.models.config import HFModelConfig
    from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu
    from vapo_megatron.parallel.reductions import global_loss_normalisers
    from vapo_megatron.step.losses import policy_loss_fn

    tp = int(os.environ["WORLD_SIZE"])
    if gpu:
        torch.distributed.init_process_group("nccl")
        torch.cuda.set_device(0)
        from megatron.core import parallel_state, tensor_parallel

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    else:
        initialize_megatron_cpu(tp=tp)
    from megatron.core import parallel_state as ps

    cfg = _model_config(gpu)
    hf = HFModelConfig.from_hf({"model_type": "qwen2", **cfg})
    dtype = torch.bfloat16 if gpu else torch.float32
    engine = ModelEngine(
        hf, ModelLayout(tp=tp), head="lm", optim=OptimSettings(), params_dtype=dtype
    )
    samples = _samples(gpu)
    micro = 4
    per = len(samples) // micro
    device = torch.device("cuda") if gpu else torch.device("cpu")
    results = {}
    for name, make in (("padded", pad), ("packed", pack)):
        mbs = [make(samples[i * per : (i + 1) * per]) for i in range(micro)]
        for mb in mbs:
            mb.tokens, mb.labels = mb.tokens.to(device), mb.labels.to(device)
            if mb.position_ids is not None:  # padded rows; packed ones carry none
                mb.position_ids = mb.position_ids.to(device)
            mb.response_mask = mb.response_mask.to(device)
            mb.fields = {k: v.to(device) for k, v in mb.fields.items()}
            if mb.packed_seq_params is not None:
                p = mb.packed_seq_params
                for attr in (
                    "cu_seqlens_q",
                    "cu_seqlens_kv",
                    "cu_seqlens_q_padded",
                    "cu_seqlens_kv_padded",
                ):
                    setattr(p, attr, getattr(p, attr).to(device))
        real = sum(len(s.prompt) + len(s.response) for s in samples)
        computed = sum(mb.tokens.numel() for mb in mbs)
        norm = global_loss_normalisers(
            [m.response_mask for m in mbs], [m.fields["positive"] for m in mbs], len(samples),
            dp_cp_group=None, cp_size=1, device=torch.device("cpu"),
        )  # fmt: skip
        loss_fn = policy_loss_fn(algo_preset("vapo"), norm, engine.vocab_slice)
        engine.run(mbs, loss_fn)  # warm-up
        times = []
        for _ in range(3):
            if gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            engine.run(mbs, loss_fn)
            if gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        best = min(times)
        mean_len = real / len(samples)
        results[name] = {
            "tokens_per_s": real / best,
            "useful_fraction": real / computed,
            "tflops": real * _flops_per_token(cfg, mean_len) / best / 1e12,
        }
    if torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps(results))
    if gpu:
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    else:
        destroy()


def run(quick: bool = False, gpu: bool = False) -> None:
    from vapo_megatron.launch.local_launch import run_local_ranks

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo), PYTHONWARNINGS="ignore")
    rows = {}
    for tp in (1,) if gpu else (1, 2):
        outputs = run_local_ranks(
            [sys.executable, __file__, WORKER_FLAG, "gpu" if gpu else "cpu"], tp,
            timeout=1800, env=env, cwd=repo,
        )  # fmt: skip
        line = next(ln for ln in outputs[0].splitlines() if ln.startswith("RESULT "))
        rows[tp] = json.loads(line.removeprefix("RESULT "))
    print(f"{'TP':>3} {'layout':>7} {'tokens/s':>10} {'useful':>7} {'TFLOP/s':>8}")
    for tp, res in rows.items():
        for name in ("padded", "packed"):
            r = res[name]
            print(
                f"{tp:>3} {name:>7} {r['tokens_per_s']:10.0f} {r['useful_fraction']:7.3f} {r['tflops']:8.3f}"
            )
    first = rows[1]
    summary = {
        "bench": "model",
        "device": "gpu" if gpu else "cpu",
        "useful_token_fraction_packed": round(first["packed"]["useful_fraction"], 3),
        "useful_token_fraction_padded": round(first["padded"]["useful_fraction"], 3),
        "packed_speedup_vs_padded": round(
            first["packed"]["tokens_per_s"] / first["padded"]["tokens_per_s"], 2
        ),
    }
    if 2 in rows:
        summary["tp2_speedup_vs_tp1_packed"] = round(
            rows[2]["packed"]["tokens_per_s"] / first["packed"]["tokens_per_s"], 2
        )
    if gpu:
        summary["mfu_packed"] = round(first["packed"]["tflops"] / H100_BF16_TFLOPS, 4)
    print(json.dumps(summary))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == WORKER_FLAG:
        worker(gpu=sys.argv[2] == "gpu")
    else:
        run(gpu="--gpu" in sys.argv)
