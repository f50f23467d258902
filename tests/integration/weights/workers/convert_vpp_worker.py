"""Worker: a DeepSeek-V3 or GLM-4.5 checkpoint written by the converter at one layout loads
into a model built with virtual pipeline stages, each chunk holding exactly the record's
shards of its own layers (4 gloo ranks).

Rank 0 writes a random tiny model (4 layers, the first dense, non-zero expert biases), the
converter writes it at TP1 x PP2 x EP2, then each load layout TP x PP x VPP x EP builds the
chunks (at PP2 x VPP2 pipeline rank 0 holds the dense layer 0 and the MoE layer 2), loads the
checkpoint (``checkpoint.load_model_weights``, what ``policy.load`` runs) and compares every
parameter and buffer with the record's shard of the HF tensors.

Usage: python convert_vpp_worker.py FAMILY "tp,pp,vpp,ep;..." TMP_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.utils import unwrap_model
from transformers import AutoModelForCausalLM

from tests.integration.weights.workers.convert_worker import convert
from vapo_megatron.checkpoint import model as ckpt
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.models.provider import build_model, transformer_config
from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu
from vapo_megatron.tiny.model import tiny_deepseek_v3_config, tiny_glm4_moe_config, train_tokenizer
from vapo_megatron.weights.gather import model_chunks_of_rank
from vapo_megatron.weights.hf_io import HFCheckpoint
from vapo_megatron.weights.record import ModelRecord


def write_model(family: str, out: Path) -> None:
    tokenizer = train_tokenizer(["12+34=46", "Answer: 46"], vocab_size=300)
    if family == "glm4_moe":
        config = tiny_glm4_moe_config(tokenizer, num_layers=4)
    else:
        config = tiny_deepseek_v3_config(tokenizer, num_layers=4, yarn=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    for layer in model.model.layers[config.first_k_dense_replace :]:
        layer.mlp.gate.e_score_correction_bias.normal_()
    model.save_pretrained(out)


def check_load(ckpt_dir: str, reference: dict, tp: int, pp: int, vpp: int, ep: int) -> int:
    """Load at TP x PP x VPP x EP; the number of tensors compared (all equal)."""
    initialize_megatron_cpu(tp=tp, pp=pp, vpp=vpp, ep=ep)
    meta = ckpt.load_metadata(ckpt_dir)
    hf = meta.model_config()
    layout = ModelLayout(tp=tp, pp=pp, vpp=vpp, ep=ep, sequence_parallel=tp > 1)
    config = transformer_config(hf, layout, params_dtype=torch.float32)
    chunks = build_model(hf, config, head="lm")
    ckpt.load_model_weights(chunks, ckpt_dir, hf=hf, head="lm")
    record = ModelRecord(hf)
    tp_rank = ps.get_tensor_model_parallel_rank()
    views = model_chunks_of_rank(
        config, ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    )
    assert len(views) == len(chunks) == vpp
    compared = 0
    for view, chunk in zip(views, chunks, strict=True):
        want = record.hf_to_megatron_shards(
            reference, tp_rank, tp, view, etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=tp
        )
        module = unwrap_model(chunk)
        held = dict(module.named_parameters()) | dict(module.named_buffers())
        unequal = [name for name, t in want.items() if not torch.equal(held[name].detach(), t)]
        assert not unequal, unequal[:5]
        compared += len(want)
    return compared


def main(family: str, specs: str, tmp: str) -> None:
    root = Path(tmp)
    initialize_megatron_cpu()
    if dist.get_rank() == 0:
        write_model(family, root / "hf")
    dist.barrier()
    ckpt_dir = str(root / "mcore")
    convert({"hf": str(root / "hf"), "out": ckpt_dir, "tp": 1, "pp": 2, "ep": 2})
    checkpoint = HFCheckpoint(root / "hf")
    reference = dict(checkpoint.read(checkpoint.names))
    for spec in specs.split(";"):
        tp, pp, vpp, ep = (int(v) for v in spec.split(","))
        count = check_load(ckpt_dir, reference, tp, pp, vpp, ep)
        print(f"rank {dist.get_rank()}: {family} TP{tp} PP{pp} VPP{vpp} EP{ep}: {count} equal")
    destroy()


if __name__ == "__main__":  # dist_checkpointing's writer spawns processes that import this file
    main(*sys.argv[1:4])
