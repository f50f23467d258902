"""Worker: one training step of a tiny DeepSeek-V3 policy with its MTP layer built
(``mtp_loss_weight`` 0.1) at full uniform activation recompute equals the step without, bit
for bit, on packed micro-batches (one rank). megatron-core 0.16.1's MTP recompute hands
``PackedSeqParams`` to its checkpoint function, and a checkpoint whose inputs need no gradient
(the trunk's detached hidden state) passes none to the MTP layer: ``models/mtp.py`` handles
both.

Usage: python mtp_recompute_worker.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.distributed.models.workers.moe_ep_step_worker import FIELDS, samples
from tests.distributed.models.workers.mtp_parity_worker import reference
from vapo_megatron.algorithms.presets import algo_preset
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.config.recompute import RecomputeSettings
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.parallel.cpu_shim import initialize_cpu_process_group
from vapo_megatron.parallel.model_groups import build_model_groups
from vapo_megatron.step.losses import policy_loss_fn
from vapo_megatron.step.updates import train_on

ALGO = algo_preset("vapo", critic_init="policy")
FULL = RecomputeSettings(granularity="full", method="uniform", num_layers=1)


def one_step(hf, tensors, data, recompute: RecomputeSettings | None):
    groups = build_model_groups(tp=1, pp=1, cp=1, ep=1)
    engine = ModelEngine(
        hf, ModelLayout(), head="lm", optim=OptimSettings(lr=1e-3, clip_grad=0.0),
        groups=groups, mtp_loss_weight=0.1, recompute=recompute,
    )  # fmt: skip
    engine.load_hf(tensors)
    vocab = engine.vocab_slice
    metrics = train_on(
        engine, data, lambda norm: policy_loss_fn(ALGO, norm, vocab, mtp_loss_weight=0.1),
        field_names=FIELDS, token_budget=32,
    )  # fmt: skip
    weights = {n: t.clone() for bucket in engine.hf_buckets(1 << 20, mtp=True) for n, t in bucket}
    return metrics, weights


def main() -> None:
    initialize_cpu_process_group()
    hf, _, _, _, tensors = reference()
    data = samples(hf.vocab_size)
    (plain, before), (full, after) = (one_step(hf, tensors, data, r) for r in (None, FULL))
    differ = sorted(name for name in before if not torch.equal(before[name], after[name]))
    assert not differ, differ
    moved = [name for name in before if not torch.equal(before[name], tensors[name])]
    assert any(name.startswith(f"model.layers.{hf.num_layers}.") for name in moved)
    assert plain["mtp_loss"] == full["mtp_loss"] and plain["pg_loss"] == full["pg_loss"]
    print(f"full recompute: {len(before)} tensors bit-identical, mtp_loss {full['mtp_loss']:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
