"""Worker: activation recompute (selective, full uniform, full block) leaves the policy's
gradients unchanged at TP2 and at CP2, and the critic's at CP2; full recompute really recomputes (it holds under 0.9 of
the bytes for backward at the peak; block with num_layers=1 recomputes one layer of four).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from tests.distributed.step.workers.train_on_worker import (
    ALGO,
    CRITIC_FIELDS,
    HF,
    OPTIM,
    POLICY_FIELDS,
    samples,
)
from tests.distributed.step.workers.train_step_worker import make_weights
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.recompute import RecomputeSettings
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.parallel.cpu_shim import initialize_cpu_process_group
from vapo_megatron.parallel.model_groups import (
    build_model_groups,
    ensure_global_memory_buffer,
    seed_rng_tracker,
)
from vapo_megatron.parallel.reductions import global_loss_normalisers
from vapo_megatron.step.batching import micro_batches
from vapo_megatron.step.losses import policy_loss_fn, value_loss_fn

RECOMPUTES = {
    "selective": RecomputeSettings(granularity="selective"),
    "full-uniform-1": RecomputeSettings(granularity="full", method="uniform", num_layers=1),
    "full-block-1": RecomputeSettings(granularity="full", method="block", num_layers=1),
}


class _Held:
    """A tensor saved for backward; freed (and uncounted) when autograd drops it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def gradients(layout, groups, sd, recompute, head="lm"):
    """(parameter name -> gradient, peak bytes held for backward) of one forward-backward."""
    engine = ModelEngine(HF, layout, head=head, optim=OPTIM, groups=groups, recompute=recompute)
    engine.load_hf(sd)
    fields = POLICY_FIELDS if head == "lm" else CRITIC_FIELDS
    mbs = micro_batches(
        samples(), layout, cp_rank=engine.cp_rank, token_budget=64, field_names=fields
    )
    positive = [mb.fields.get("positive", torch.zeros_like(mb.response_mask)) for mb in mbs]
    norm = global_loss_normalisers(
        [mb.response_mask for mb in mbs], positive, len(samples()),
        dp_cp_group=engine.groups.parallel.dp_cp, cp_size=layout.cp, device=engine.device,
    )  # fmt: skip
    live, peak = [0], [0]

    def pack(t: torch.Tensor) -> _Held:
        held, size = _Held(t), t.numel() * t.element_size()
        live[0] += size
        peak[0] = max(peak[0], live[0])
        weakref.finalize(held, lambda: live.__setitem__(0, live[0] - size))
        return held

    loss_fn = (
        policy_loss_fn(ALGO, norm, engine.vocab_slice)
        if head == "lm"
        else value_loss_fn(ALGO, norm)
    )
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.tensor):
        engine.run(mbs, loss_fn)
    assert engine.config.recompute_granularity == (recompute and recompute.granularity)
    grads = {n: p.main_grad.clone() for n, p in engine.chunks[0].named_parameters()}
    return grads, peak[0]


def main() -> None:
    initialize_cpu_process_group()
    policy_sd, critic_sd = make_weights()
    layouts = {
        "TP2": (ModelLayout(tp=2), build_model_groups(tp=2, pp=1, cp=1)),
        "CP2": (ModelLayout(cp=2), build_model_groups(tp=1, pp=1, cp=2)),
    }
    ensure_global_memory_buffer()
    for name, (layout, groups) in layouts.items():
        seed_rng_tracker(groups)
        want, saved_plain = gradients(layout, groups, policy_sd, None)
        for label, recompute in RECOMPUTES.items():
            got, saved = gradients(layout, groups, policy_sd, recompute)
            worst = max((got[n] - want[n]).abs().max().item() for n in want)
            assert worst <= 1e-6, f"{name} {label}: gradients differ by {worst}"
            # Selective recompute drops the [s, s] attention scores, nothing at these lengths.
            if recompute.granularity == "full":
                assert saved < 0.9 * saved_plain, f"{name} {label}: saved {saved} / {saved_plain}"
            print(
                f"rank {dist.get_rank()}: {name} {label}: same gradients (max diff {worst:.1e}), "
                f"peak held for backward {saved / saved_plain:.2f} of no recompute",
                flush=True,
            )
    # The critic (value head) at CP2 too.
    layout, groups = layouts["CP2"]
    want, _ = gradients(layout, groups, critic_sd, None, head="value")
    got, _ = gradients(layout, groups, critic_sd, RECOMPUTES["full-uniform-1"], head="value")
    worst = max((got[n] - want[n]).abs().max().item() for n in want)
    assert worst <= 1e-6, f"critic CP2: gradients differ by {worst}"
    print(f"rank {dist.get_rank()}: critic CP2 full-uniform-1: same gradients", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
