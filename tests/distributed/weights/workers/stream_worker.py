"""Worker: the policy weight stream gives every rank the exact HF tensors, at TP/PP layouts.

Usage: python stream_worker.py "2x1,1x2,..." (TP x PP).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu
from vapo_megatron.weights.stream import stream_plan

BUCKET = 64 * 1024


def main() -> None:
    for tie in (False, True):
        config = Qwen2Config(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, num_hidden_layers=4, vocab_size=250,
            max_position_embeddings=256, rope_theta=1e6, tie_word_embeddings=tie,
        )  # fmt: skip
        torch.manual_seed(0)
        reference = Qwen2ForCausalLM(config).float().state_dict()
        if tie:
            reference.pop("lm_head.weight")
        hf = HFModelConfig.from_hf(config.to_dict())
        for spec in sys.argv[1].split(","):
            tp, pp = (int(v) for v in spec.split("x"))
            initialize_megatron_cpu(tp=tp, pp=pp)
            engine = ModelEngine(hf, ModelLayout(tp=tp, pp=pp), head="lm", optim=OptimSettings())
            engine.load_hf(reference)
            plan = [
                (name, tuple(meta.shape), meta.dtype)
                for name, meta in stream_plan(engine.record, engine.config, pp_size=pp)
            ]
            names = []
            for bucket in engine.hf_buckets(BUCKET):
                size = sum(t.numel() * t.element_size() for _, t in bucket)
                assert size <= BUCKET or len(bucket) == 1, (size, len(bucket))
                for name, tensor in bucket:
                    assert torch.equal(tensor, reference[name]), name
                    assert plan[len(names)] == (name, tuple(tensor.shape), tensor.dtype)
                    names.append(name)
            assert sorted(names) == sorted(reference), set(names) ^ set(reference)
            assert len(names) == len(set(names))
            assert len(names) == len(plan), "the stream yields every tensor of its plan"
            print(f"rank {dist.get_rank()}: tie={tie} TP{tp}xPP{pp}: {len(names)} tensors exact")
    destroy()


if __name__ == "__main__":
    main()
