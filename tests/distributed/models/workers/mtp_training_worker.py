"""Worker: a tiny DeepSeek-V3 policy with one MTP layer trained two steps through the trainer's
own path (``ModelEngine`` + ``step/updates.py::train_on`` + ``losses.policy_loss_fn``) at
EP 2 on 2 ranks (the tiny DeepSeek recipe's layout), once with the MTP layer built and trained
(``mtp_loss_weight=0.1``) and once on the frozen path (weight 0: no MTP layer built).

Checks (rank 0 prints each): the record round trip with the MTP layer in the model is
bit-identical (HF in, the stream's HF tensors out, the shared-head copies excepted: export
writes them); the rollout stream holds no MTP tensor; ``mtp_loss`` is logged, finite and falls;
the MTP layer's weights change; the main model's weights and PPO metrics after both steps are
bit-identical to the frozen path's (the MTP loss reaches the MTP layer only; clipping off: the
gradient norm counts the MTP layer's gradients); routing replay takes the decoder's routers
only, not the MTP layer's.

And the training checkpoint with the MTP layer (megatron's dist-checkpointing) resumes: a
fresh engine loaded from it takes the same third step.

At PP 2 the last stage's copy of the embedding (which the MTP layer reads) follows the
trained embedding.

Usage: python mtp_training_worker.py CHECKPOINT_ROOT ep2|pp2|tp2
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.utils import unwrap_model

from tests.distributed.models.workers.moe_ep_step_worker import FIELDS, samples
from tests.distributed.models.workers.mtp_parity_worker import reference
from vapo_megatron.algorithms.presets import algo_preset
from vapo_megatron.checkpoint.load import load_train_checkpoint
from vapo_megatron.checkpoint.save import save_train_checkpoint
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.parallel.cpu_shim import initialize_cpu_process_group
from vapo_megatron.parallel.model_groups import build_model_groups
from vapo_megatron.step.losses import policy_loss_fn
from vapo_megatron.step.updates import train_on
from vapo_megatron.weights.mtp import is_mtp_tensor

OPTIM = OptimSettings(lr=1e-3, weight_decay=0.0, clip_grad=0.0)
LAYOUTS = {"ep2": (1, 1, 2), "pp2": (1, 2, 1), "tp2": (2, 1, 1)}
"""Layout name -> (TP, PP, EP) on 2 ranks (TP with sequence parallelism)."""
ALGO = algo_preset("vapo", critic_init="policy")
WEIGHT = 0.1


def make_engine(hf, weight: float) -> ModelEngine:
    tp, pp, ep = LAYOUTS[sys.argv[2]]
    groups = build_model_groups(tp=tp, pp=pp, cp=1, ep=ep)
    layout = ModelLayout(tp=tp, pp=pp, ep=ep, sequence_parallel=tp > 1)
    engine = ModelEngine(hf, layout, head="lm", optim=OPTIM, groups=groups, mtp_loss_weight=weight)
    # Routing replay drives the decoder's routers only (no routes given here: each keeps its
    # own top-k); the MTP layer's router, layer number past num_layers, is not among them.
    engine.track_routes(replay=True)
    layers = engine.router_replay.layers
    assert layers and all(hf.first_k_dense <= layer < hf.num_layers for layer in layers), layers
    return engine


def step(engine: ModelEngine, data, weight: float) -> dict:
    vocab = engine.vocab_slice
    return train_on(
        engine, data, lambda norm: policy_loss_fn(ALGO, norm, vocab, mtp_loss_weight=weight),
        field_names=FIELDS, token_budget=32,
    )  # fmt: skip


def train(hf, tensors, data, weight: float, root: Path):
    """(HF weights after two steps, the steps' metrics)."""
    engine = make_engine(hf, weight)
    engine.load_hf(tensors)
    if weight:
        check_round_trip(engine, hf, tensors)
    steps = [step(engine, data, weight) for _ in range(2)]
    weights = whole_model(engine)
    if weight and engine.layout.pp > 1 and engine.is_last_stage:
        # The MTP layers' copy of the embedding took the first stage's steps (megatron's
        # all-reduce of its gradient over the embedding group; the MTP loss adds none).
        copy = unwrap_model(engine.chunks[0]).embedding.word_embeddings.weight
        assert torch.equal(copy[: hf.vocab_size], weights["model.embed_tokens.weight"])
        print("the last stage's embedding copy equals the trained embedding")
    if weight:
        check_resume(engine, hf, data, root)
    return weights, steps


def whole_model(engine: ModelEngine) -> dict[str, torch.Tensor]:
    """Every HF tensor of the model (every stage's), the MTP layer's included."""
    return {
        name: t.clone() for bucket in engine.hf_buckets(1 << 20, mtp=True) for name, t in bucket
    }


def check_resume(engine: ModelEngine, hf, data, root: Path) -> None:
    """The training checkpoint (megatron's dist-checkpointing: model with its MTP layer,
    optimizer, scheduler) resumes exactly: a fresh engine loaded from it takes the same third
    step as the engine that saved it."""
    save_train_checkpoint(root, 2, {"policy": engine.trainable_state()}, {}, keep_last=1)
    resumed = make_engine(hf, WEIGHT)
    load_train_checkpoint(root, {"policy": resumed.trainable_state()})
    after = [step(e, data, WEIGHT) for e in (engine, resumed)]
    assert after[0]["mtp_loss"] == after[1]["mtp_loss"], after
    mine, theirs = whole_model(engine), whole_model(resumed)
    assert mine.keys() == theirs.keys() and any(is_mtp_tensor(hf, name) for name in mine)
    for name, tensor in mine.items():
        assert torch.equal(tensor, theirs[name]), f"{name} differs after resuming"
    if dist.get_rank() == 0:
        print(f"resume: the third step equal after a checkpoint ({len(mine)} tensors)")


def check_round_trip(engine: ModelEngine, hf, tensors) -> None:
    """HF -> the model -> HF is bit-identical with the MTP layer in the model; the rollout
    stream leaves it out."""
    back = {
        name: t.clone() for bucket in engine.hf_buckets(1 << 20, mtp=True) for name, t in bucket
    }
    copies = {
        f"model.layers.{hf.num_layers}.{n}"
        for n in ("shared_head.head.weight", "embed_tokens.weight")
    }
    assert set(back) == set(tensors) - copies, set(back) ^ (set(tensors) - copies)
    for name, tensor in back.items():
        assert torch.equal(tensor, tensors[name]), name
    rollout = [name for bucket in engine.hf_buckets(1 << 20) for name, _ in bucket]
    assert rollout and not any(is_mtp_tensor(hf, name) for name in rollout)
    if dist.get_rank() == 0:
        print(f"round trip: {len(back)} tensors bit-identical; rollout stream {len(rollout)}")


def main() -> None:
    initialize_cpu_process_group()
    hf, _, _, _, tensors = reference()
    data = samples(hf.vocab_size)
    root = Path(sys.argv[1])
    trained, mtp_steps = train(hf, tensors, data, WEIGHT, root)
    without_mtp = {k: v for k, v in tensors.items() if not is_mtp_tensor(hf, k)}
    frozen, frozen_steps = train(hf, without_mtp, data, 0.0, root)
    if dist.get_rank() != 0:
        dist.destroy_process_group()
        return
    losses = [step["mtp_loss"] for step in mtp_steps]
    assert all(math.isfinite(x) and x > 0 for x in losses) and losses[1] < losses[0], losses
    assert not any("mtp_loss" in step for step in frozen_steps)
    mtp_names = [name for name in trained if is_mtp_tensor(hf, name)]
    moved = [name for name in mtp_names if not torch.equal(trained[name], tensors[name])]
    assert set(trained) - set(mtp_names) == set(frozen)
    assert len(moved) > len(mtp_names) // 2, (len(moved), len(mtp_names))
    for name, tensor in frozen.items():
        assert torch.equal(trained[name], tensor), f"{name} differs from the frozen path's"
    for key in ("pg_loss", "entropy"):
        assert [s[key] for s in mtp_steps] == [s[key] for s in frozen_steps], key
    print(
        f"mtp_loss {losses[0]:.4f} -> {losses[1]:.4f}; {len(moved)}/{len(mtp_names)} MTP tensors "
        f"moved; main model bit-identical to the frozen path ({len(frozen)} tensors); grad_norm "
        f"{mtp_steps[0]['grad_norm']:.4f} vs {frozen_steps[0]['grad_norm']:.4f}"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
