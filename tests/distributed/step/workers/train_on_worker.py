"""Worker: the trainer's mini-batch update (step/updates.py::train_on: data-parallel
shares, token-budget micro-batches, normalisers before backward) gives the same updated
weights for any split: DP2 with many small micro-batches, TP2 with one, and a single process.

verl #5702 (critic gradients not reduced over DP) and #6957 (critic loss normalised per
micro-batch) would both show here as weights that differ between the splits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.distributed.step.workers.train_step_worker import HF_CONFIG, VOCAB, make_weights
from vapo_megatron.algorithms.presets import algo_preset
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.data.packing import Sample
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.cpu_shim import initialize_cpu_process_group
from vapo_megatron.parallel.model_groups import (
    build_model_groups,
    ensure_global_memory_buffer,
    seed_rng_tracker,
)
from vapo_megatron.step.batching import FLAT_INDEX
from vapo_megatron.step.losses import policy_loss_fn, value_loss_fn
from vapo_megatron.step.updates import train_on

OPTIM = OptimSettings(lr=1e-3, weight_decay=0.0, adam_eps=1e-6, clip_grad=0.5)
ALGO = algo_preset("vapo", value_clip=0.5, critic_init="policy")
CRITIC_FIELDS = [FLAT_INDEX, "returns", "old_values"]
POLICY_FIELDS = [FLAT_INDEX, "old_logprobs", "advantages", "positive", "seq_num_tokens"]


def samples() -> list[Sample]:
    gen = torch.Generator().manual_seed(3)
    out, offset = [], 0
    for i in range(11):  # odd: the DP shares differ in size
        n_prompt, n_resp = 2 + i % 4, 3 + (7 * i) % 9
        prompt = torch.randint(0, VOCAB, (n_prompt,), generator=gen).tolist()
        response = torch.randint(0, VOCAB, (n_resp,), generator=gen).tolist()
        fields = {
            FLAT_INDEX: torch.arange(offset, offset + n_resp),
            "returns": torch.randn(n_resp, generator=gen),
            "old_values": torch.randn(n_resp, generator=gen) * 0.1,
            "old_logprobs": -5.0 + 0.3 * torch.randn(n_resp, generator=gen),
            "advantages": torch.randn(n_resp, generator=gen),
            "positive": torch.full((n_resp,), i % 3 == 0),
            "seq_num_tokens": torch.full((n_resp,), float(n_resp)),
        }
        offset += n_resp
        out.append(Sample(prompt, response, fields))
    return out


def updated(head, layout, groups, sd, budget):
    engine = ModelEngine(HF, layout, head=head, optim=OPTIM, groups=groups)
    engine.load_hf(sd)
    if head == "value":
        factory, names = (lambda norm: value_loss_fn(ALGO, norm)), CRITIC_FIELDS
    else:
        vocab = engine.vocab_slice
        factory, names = (lambda norm: policy_loss_fn(ALGO, norm, vocab)), POLICY_FIELDS
    metrics = train_on(engine, samples(), factory, field_names=names, token_budget=budget)
    return dict(engine.hf_weights()), metrics


HF = HFModelConfig.from_hf(HF_CONFIG.to_dict())


def main() -> None:
    initialize_cpu_process_group()
    policy_sd, critic_sd = make_weights()
    dp2 = build_model_groups(tp=1, pp=1, cp=1)
    tp2 = build_model_groups(tp=2, pp=1, cp=1)
    ensure_global_memory_buffer()
    seed_rng_tracker(dp2)
    for head, sd in (("value", critic_sd), ("lm", policy_sd)):
        many, m_many = updated(head, ModelLayout(), dp2, sd, budget=24)
        one, m_one = updated(head, ModelLayout(tp=2), tp2, sd, budget=10_000)
        key = "value_loss" if head == "value" else "pg_loss"
        assert abs(m_many[key] - m_one[key]) < 1e-5, (head, m_many[key], m_one[key])
        assert abs(m_many["grad_norm"] / m_one["grad_norm"] - 1) < 1e-5, (m_many, m_one)
        worst = max((many[name] - one[name]).abs().max().item() for name in one)
        assert worst < 2e-5, f"{head}: DP2 x many micro-batches vs TP2 x one: {worst}"
        print(
            f"rank {dist.get_rank()}: {head}: DP2 (budget 24) = TP2 (one micro-batch): weights "
            f"max diff {worst:.2e}, {key} {m_many[key]:.6f}",
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
