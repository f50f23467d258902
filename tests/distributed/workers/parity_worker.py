"""Worker: the production model path (provider + default layer spec + ModelEngine) gives the
logits of ``Qwen2ForCausalLM`` and the values of an HF critic, at every (TP, PP, CP) layout,
for padded and for packed batches.

Usage: python parity_worker.py "1x1x1,2x1x1,..."  (TP x PP x CP; DP takes the other ranks).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Model

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.data.packing import Sample, pack, pad
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.context_parallel import split_for_cp, split_packed_for_cp
from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu

VOCAB = 250  # padded to 256 (TP1, TP2): the padded logits must not leak into anything
HF_CONFIG = Qwen2Config(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, num_hidden_layers=4, vocab_size=VOCAB, max_position_embeddings=256,
    rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
)  # fmt: skip
LENGTHS = [(3, 9), (6, 2), (2, 5), (5, 7)]  # (prompt, response) per sample


def reference():
    torch.manual_seed(0)
    policy = Qwen2ForCausalLM(HF_CONFIG).float().eval()
    trunk = Qwen2Model(HF_CONFIG).float().eval()
    trunk.load_state_dict(policy.model.state_dict())
    score = torch.randn(1, HF_CONFIG.hidden_size) * 0.1
    gen = torch.Generator().manual_seed(1)
    samples, logits, values = [], [], []
    for n_prompt, n_resp in LENGTHS:
        tokens = torch.randint(0, VOCAB, (n_prompt + n_resp,), generator=gen)
        samples.append(Sample(tokens[:n_prompt].tolist(), tokens[n_prompt:].tolist()))
        with torch.no_grad():
            logits.append(policy(tokens[None]).logits[0])
            values.append(trunk(tokens[None]).last_hidden_state[0] @ score.T)
    policy_sd = dict(policy.state_dict())
    critic_sd = {k: v for k, v in policy_sd.items() if k != "lm_head.weight"} | {
        "score.weight": score
    }
    return samples, logits, values, policy_sd, critic_sd


def gather_full(local: torch.Tensor, mb, layout: ModelLayout) -> torch.Tensor:
    """This micro-batch's output over the full rows: TP slices joined, CP shards merged."""
    if layout.tp > 1 and local.shape[-1] > 1:  # vocab-parallel logits
        parts = [torch.empty_like(local) for _ in range(layout.tp)]
        dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
        local = torch.cat(parts, dim=-1)
    if layout.cp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(layout.cp)]
    dist.all_gather(parts, local.contiguous(), group=ps.get_context_parallel_group())
    if mb.packed_seq_params is None:  # [b, s / cp, v] shards in the load-balanced layout
        width = local.shape[1] * layout.cp
        full = local.new_zeros(local.shape[0], width, local.shape[-1])
        for rank, part in enumerate(parts):
            full[:, split_for_cp(torch.arange(width)[None], layout.cp, rank)[0]] = part
        return full
    cu = mb.packed_seq_params.cu_seqlens_q_padded
    full = local.new_zeros(1, int(cu[-1]), local.shape[-1])
    for rank, part in enumerate(parts):
        full[0, split_packed_for_cp(torch.arange(int(cu[-1])), cu, layout.cp, rank)] = part[0]
    return full


def rows_of(full: torch.Tensor, mb, count: int) -> list[torch.Tensor]:
    """Per-sample outputs [len, v] (real tokens only) from a micro-batch's full output."""
    if mb.packed_seq_params is None:
        return [full[b] for b in range(count)]
    cu = mb.packed_seq_params.cu_seqlens_q_padded.tolist()
    return [full[0, cu[i] : cu[i + 1]] for i in range(count)]


def check(name: str, layout: ModelLayout, samples, logits, values, sds) -> None:
    initialize_megatron_cpu(tp=layout.tp, pp=layout.pp, cp=layout.cp)
    hf = HFModelConfig.from_hf(HF_CONFIG.to_dict())
    cp_rank = ps.get_context_parallel_rank()
    for head, sd, refs in (("lm", sds[0], logits), ("value", sds[1], values)):
        engine = ModelEngine(hf, layout, head=head, optim=OptimSettings())
        engine.load_hf(sd)
        for make in (pad, pack):
            mbs = [
                make(samples[i : i + 2], cp_size=layout.cp, cp_rank=cp_rank, pad_multiple=8)
                for i in (0, 2)
            ]
            outs = engine.run(
                mbs, lambda out, mb: (out.sum() * 0, {"out": out.detach()}), forward_only=True
            )
            if not ps.is_pipeline_last_stage():
                continue
            worst = 0.0
            for i, (mb, out) in enumerate(zip(mbs, outs, strict=True)):
                full = gather_full(out["out"], mb, layout)
                for j, got in enumerate(rows_of(full, mb, 2)):
                    want = refs[2 * i + j]
                    got = got[: want.shape[0], : want.shape[-1]]
                    worst = max(worst, (got - want).abs().max().item())
                    if head == "lm":  # padded vocabulary rows stay exactly zero
                        assert not full[..., VOCAB:].any()
            assert worst < 2e-5, f"{name} {head} {make.__name__}: max diff {worst}"
            print(f"rank {dist.get_rank()}: {name} {head} {make.__name__}: max diff {worst:.2e}")


def main() -> None:
    samples, logits, values, policy_sd, critic_sd = reference()
    for spec in sys.argv[1].split(","):
        tp, pp, cp = (int(v) for v in spec.split("x"))
        check(
            spec, ModelLayout(tp=tp, pp=pp, cp=cp), samples, logits, values, (policy_sd, critic_sd)
        )
    destroy()


if __name__ == "__main__":
    main()
