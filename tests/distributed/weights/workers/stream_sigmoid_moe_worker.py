"""Worker: the weight stream of a DeepSeek-V3 or GLM-4.5 policy under virtual pipeline stages
gives every rank the exact HF tensors (expert-score bias included), in the plan's order, and
each model chunk holds the record's shards of its own layers (4 ranks).

The tiny model has 4 layers, the first dense: at PP 2 x VPP 2 pipeline rank 0 holds layer 0
(dense) in its first chunk and layer 2 (MoE) in its second, rank 1 layers 1 and 3, so a chunk
built or named from the wrong layer offset fails the shard check or the stream's.

Usage: python stream_sigmoid_moe_worker.py FAMILY "tp,pp,vpp,ep;..." TMP_DIR
(FAMILY: deepseek_v3 or glm4_moe).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from megatron.core.utils import unwrap_model
from transformers import AutoModelForCausalLM

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu
from vapo_megatron.tiny.model import tiny_deepseek_v3_config, tiny_glm4_moe_config, train_tokenizer
from vapo_megatron.weights.gather import model_chunks_of_rank
from vapo_megatron.weights.stream import stream_plan, stream_policy_weights

BUCKET = 16 * 1024  # smaller than one layer's experts (8 x 3 x 32 x 64 x 4 B = 192 KiB)


def reference_state(family: str, tmp: str) -> tuple[HFModelConfig, dict[str, torch.Tensor]]:
    """Random HF tensors as transformers writes them (rank 0 writes, all read), the expert
    biases non-zero (transformers makes them zero)."""
    from vapo_megatron.weights.hf_io import HFCheckpoint

    tokenizer = train_tokenizer(["12+34=46", "Answer: 46"], vocab_size=300)
    if family == "glm4_moe":
        config = tiny_glm4_moe_config(tokenizer, num_layers=4)
    else:
        config = tiny_deepseek_v3_config(tokenizer, num_layers=4)
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float()
        for layer in model.model.layers[config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.normal_()
        model.save_pretrained(tmp)
    dist.barrier()
    checkpoint = HFCheckpoint(tmp)
    return HFModelConfig.from_hf(config.to_dict()), dict(checkpoint.read(checkpoint.names))


def check_layout(hf: HFModelConfig, reference: dict, tp: int, pp: int, vpp: int, ep: int) -> int:
    """Load, check each chunk's shards against the record's, stream; the tensors streamed."""
    initialize_megatron_cpu(tp=tp, pp=pp, vpp=vpp, ep=ep)
    layout = ModelLayout(tp=tp, pp=pp, vpp=vpp, ep=ep, sequence_parallel=tp > 1)
    engine = ModelEngine(hf, layout, head="lm", optim=OptimSettings())
    engine.load_hf(reference)
    groups = engine.groups
    chunks = model_chunks_of_rank(engine.config, groups.pp_rank, groups.ep_rank)
    assert len(chunks) == len(engine.chunks) == vpp
    for chunk, model in zip(chunks, engine.chunks, strict=True):
        own = engine.record.hf_to_megatron_shards(
            reference, groups.tp_rank, tp, chunk, etp_rank=groups.etp_rank, etp_size=tp
        )
        module = unwrap_model(model)
        held = dict(module.named_parameters()) | dict(module.named_buffers())
        assert all(torch.equal(held[name].detach(), want) for name, want in own.items())
    plan = [(n, tuple(m.shape)) for n, m in stream_plan(engine.record, engine.config, pp_size=pp)]
    pgs = groups.pg_collection
    names = []
    for bucket in stream_policy_weights(
        engine.chunks, engine.record, engine.config, tp_group=pgs.tp, pp_group=pgs.pp,
        bucket_bytes=BUCKET, ep_group=pgs.ep, expt_tp_group=pgs.expt_tp,
    ):  # fmt: skip
        for name, tensor in bucket:
            assert torch.equal(tensor, reference[name]), name
            assert plan[len(names)] == (name, tuple(tensor.shape)), (plan[len(names)], name)
            names.append(name)
    assert sorted(names) == sorted(reference), sorted(set(reference) ^ set(names))[:5]
    assert sum(".e_score_correction_bias" in n for n in names) == hf.num_layers - 1
    return len(names)


def main(family: str, specs: str, tmp: str) -> None:
    initialize_megatron_cpu()
    hf, reference = reference_state(family, tmp)
    for spec in specs.split(";"):
        tp, pp, vpp, ep = (int(v) for v in spec.split(","))
        count = check_layout(hf, reference, tp, pp, vpp, ep)
        print(f"rank {dist.get_rank()}: {family} TP{tp} PP{pp} VPP{vpp} EP{ep}: {count} exact")
    destroy()


if __name__ == "__main__":
    main(*sys.argv[1:4])
