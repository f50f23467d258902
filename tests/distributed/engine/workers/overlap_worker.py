"""Worker: with the distributed optimizer at DP2, overlapped gradient reduction and parameter
gather (``gpu.overlap_grad_reduce`` / ``overlap_param_gather``) give the same losses, grad
norms, scores and weights as the plain path, over updates whose micro-batch count changes
(3, then 1, then 2) and a scoring pass after an update.

The overlaps are a GPU setting (``resolve`` refuses them without CUDA); here ``resolve`` is
told CUDA is present so megatron's asynchronous handles run over gloo. Without the engine's
``no_sync_func`` the first micro-batch's backward would reduce the buckets (wrong gradients);
without ``gather_params`` the weight read after an update would see stale shards.
"""

from __future__ import annotations

import functools

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
from vapo_megatron.config import gpu as gpu_settings
from vapo_megatron.config.gpu import GpuSettings
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.engine import model_engine
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.parallel.cpu_shim import initialize_cpu_process_group
from vapo_megatron.parallel.model_groups import build_model_groups, seed_rng_tracker
from vapo_megatron.step.losses import logprob_scoring_fn, policy_loss_fn, value_loss_fn
from vapo_megatron.step.outputs import score_flat
from vapo_megatron.step.updates import train_on

NO_FUSIONS = dict(
    bias_activation_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
    gradient_accumulation_fusion=False,
)  # fmt: skip
OVERLAP = GpuSettings(overlap_grad_reduce=True, overlap_param_gather=True, **NO_FUSIONS)
PLAIN = GpuSettings(overlap_grad_reduce=False, overlap_param_gather=False, **NO_FUSIONS)
# (samples, token budget): 3, 1 and 2 micro-batches on each DP rank.
PARTS = ((slice(0, 11), 40), (slice(0, 5), 10_000), (slice(3, 11), 60))


def run(head, sd, groups, gpu):
    optim = OptimSettings(**{**OPTIM.__dict__, "distributed_optimizer": True})
    engine = ModelEngine(HF, ModelLayout(), head=head, optim=optim, groups=groups, gpu=gpu)
    engine.load_hf(sd)
    if head == "value":
        factory, names = (lambda norm: value_loss_fn(ALGO, norm)), CRITIC_FIELDS
    else:
        vocab = engine.vocab_slice
        factory, names = (lambda norm: policy_loss_fn(ALGO, norm, vocab)), POLICY_FIELDS
    trace = []
    for part, budget in PARTS:
        m = train_on(engine, samples()[part], factory, field_names=names, token_budget=budget)
        trace += [m["grad_norm"], m["value_loss" if head == "value" else "pg_loss"]]
    if head == "lm":  # a forward-only pass right after an update (the pre-hooks gather)
        chosen = samples()
        scores = score_flat(
            engine, [s.prompt for s in chosen], [s.response for s in chosen],
            scoring_fn=logprob_scoring_fn(engine.vocab_slice), output_key="logprobs",
            token_budget=40,
        )  # fmt: skip
        trace += scores.tolist()
    return trace, dict(engine.hf_weights()), engine.config.no_sync_func


def main() -> None:
    initialize_cpu_process_group()
    # The overlaps are refused without CUDA; megatron's asynchronous path itself runs on gloo.
    model_engine.resolve = functools.partial(gpu_settings.resolve, cuda=True)
    policy_sd, critic_sd = make_weights()
    groups = build_model_groups(tp=1, pp=1, cp=1)
    seed_rng_tracker(groups)
    for head, sd in (("value", critic_sd), ("lm", policy_sd)):
        plain, plain_weights, plain_hook = run(head, sd, groups, PLAIN)
        overlap, overlap_weights, overlap_hook = run(head, sd, groups, OVERLAP)
        assert plain_hook is None and overlap_hook is not None, (plain_hook, overlap_hook)
        trace = max(abs(a - b) for a, b in zip(plain, overlap, strict=True))
        worst = max(
            (plain_weights[n] - overlap_weights[n]).abs().max().item() for n in plain_weights
        )
        assert trace < 1e-5 and worst < 1e-6, f"{head}: trace diff {trace}, weights diff {worst}"
        moved = max((plain_weights[n] - sd[n]).abs().max().item() for n in plain_weights)
        assert moved > 1e-4, f"{head}: the updates did not move the weights ({moved})"
        print(
            f"rank {dist.get_rank()}: {head}: overlapped = plain over 3/1/2 micro-batches: "
            f"losses, grad norms, scores max diff {trace:.1e}, weights {worst:.1e} "
            f"(moved {moved:.1e})",
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
