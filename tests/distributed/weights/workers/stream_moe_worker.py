"""Worker: the weight stream of a Qwen3-MoE policy gives every rank the exact HF tensors, in
the plan's order, at layouts with expert parallelism and expert TP (4 ranks).

Each layout: load the HF tensors (each rank its EP rank's experts, its expert-TP slice), stream
to every rank, compare every tensor with the original and with the plan, and check that a
rank's own expert shards are the record's (so a rank holding the wrong experts would fail).

Usage: python stream_moe_worker.py "tp,pp,ep,etp;..." (etp 0: the default, TP).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from megatron.core.utils import unwrap_model
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu
from vapo_megatron.weights.stream import stream_plan, stream_policy_weights

BUCKET = 16 * 1024  # smaller than one layer's experts (4 x 3 x 32 x 64 x 4 B = 96 KiB)
CONFIG = Qwen3MoeConfig(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
    norm_topk_prob=True, num_hidden_layers=2, vocab_size=250, max_position_embeddings=128,
    tie_word_embeddings=False,
)  # fmt: skip


def reference_state(tmp: str) -> dict[str, torch.Tensor]:
    """Random per-expert HF tensors as transformers writes them (rank 0 writes, all read)."""
    from vapo_megatron.weights.hf_io import HFCheckpoint

    if dist.get_rank() == 0:
        torch.manual_seed(0)
        Qwen3MoeForCausalLM(CONFIG).float().save_pretrained(tmp)
    dist.barrier()
    checkpoint = HFCheckpoint(tmp)
    return dict(checkpoint.read(checkpoint.names))


def check_layout(hf, reference, tp, pp, ep, etp) -> int:
    initialize_megatron_cpu(tp=tp, pp=pp, ep=ep, etp=etp)
    layout = ModelLayout(tp=tp, pp=pp, ep=ep, etp=etp, sequence_parallel=tp > 1 and ep > 1)
    engine = ModelEngine(hf, layout, head="lm", optim=OptimSettings())
    engine.load_hf(reference)
    own = engine.record.hf_to_megatron_shards(
        reference, engine.groups.tp_rank, tp, _own_chunk(engine),
        etp_rank=engine.groups.etp_rank, etp_size=layout.expert_tp,
    )  # fmt: skip
    params = dict(unwrap_model(engine.chunks[0]).named_parameters())
    assert all(torch.equal(params[name].detach(), want) for name, want in own.items())
    plan = [(n, tuple(m.shape)) for n, m in stream_plan(engine.record, engine.config, pp_size=pp)]
    names = []
    for bucket in stream_policy_weights(
        engine.chunks, engine.record, engine.config,
        tp_group=engine.groups.pg_collection.tp, pp_group=engine.groups.pg_collection.pp,
        bucket_bytes=BUCKET, ep_group=engine.groups.pg_collection.ep,
        expt_tp_group=engine.groups.pg_collection.expt_tp,
    ):  # fmt: skip
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= BUCKET or len(bucket) == 1, (size, len(bucket))
        for name, tensor in bucket:
            assert torch.equal(tensor, reference[name]), name
            assert plan[len(names)] == (name, tuple(tensor.shape)), (plan[len(names)], name)
            names.append(name)
    assert sorted(names) == sorted(reference), sorted(set(reference) ^ set(names))[:5]
    return len(names)


def _own_chunk(engine):
    from vapo_megatron.weights.gather import model_chunks_of_rank

    return model_chunks_of_rank(engine.config, engine.groups.pp_rank, engine.groups.ep_rank)[0]


def main(specs: str, tmp: str) -> None:
    initialize_megatron_cpu()
    reference = reference_state(tmp)
    hf = HFModelConfig.from_hf(CONFIG.to_dict())
    for spec in specs.split(";"):
        tp, pp, ep, etp = (int(v) for v in spec.split(","))
        count = check_layout(hf, reference, tp, pp, ep, etp or None)
        print(f"rank {dist.get_rank()}: TP{tp} PP{pp} EP{ep} ETP{etp or tp}: {count} exact")
    destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
