"""Two builds of the tiny MoE on the same weights and the same routes, compared: logits of a
forward pass and every parameter's gradient as full HF-named tensors.

Routes first: the two builds compute each router's input with other kernels (TE's fused norm
or another GEMM shape), so in bf16 a token near a tie between two experts could pick another
one and move its logits by far more than rounding. The reference records its routers' top-k
(``ModelEngine.run(record_routes=True)``, made whole rows by ``step/critic_routes.whole_rows``)
and the other build replays them (``ROUTES``, the trainer's routing replay): both then compute
the same function, and the share of the given experts the other build's own top-k also picked
is reported (the routers' agreement).

Gradients are read where Adam reads them (each parameter's ``main_grad`` after the schedule's
``finalize_model_grads``) and mapped to HF names by the model's record
(``weights/record.py::megatron_to_hf``), so a local-spec model (``local_experts.{j}``) and a TE
model (``linear_fc1.weight{j}``), or an EP 2 rank (its own experts, global names) and an EP 1
one, are compared tensor by tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from vapo_megatron.data.packing import MicroBatch
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.step.batching import ROUTES
from vapo_megatron.step.critic_routes import whole_rows
from vapo_megatron.weights.gather import chunk_parameters, model_chunks_of_rank

GRAD_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
"""Allowed ||g - g_ref|| / max(||g_ref||, 1e-3 max_tensors ||g_ref||) per HF tensor: fp32 sums
in another order agree to ~1e-6; bf16 activations round to 8 bits a few times per layer on the
way there and back. A wrong expert, mapping or scaling is off by order 1 (the floor keeps an
expert that got one token from being held to a relative bound on a near-zero gradient)."""


def keep_logits(vocab: int):
    """A forward-only loss function that keeps each micro-batch's logits [t, vocab] (fp32)."""

    def fn(logits: torch.Tensor, mb: MicroBatch):
        kept = logits[0, :, :vocab].detach().float().clone()
        return logits.new_zeros((), dtype=torch.float32), {"logits": kept}

    return fn


def logsumexp_loss(vocab: int):
    """A loss that reaches every weight: the log-partition of the response positions' logits,
    summed and divided by a constant (a share of a global sum, as the step's losses are)."""

    def fn(logits: torch.Tensor, mb: MicroBatch):
        mask = mb.response_mask.to(logits.device).float()
        return (torch.logsumexp(logits[..., :vocab].float(), -1) * mask).sum() / 100.0, {}

    return fn


def record_routes(
    engine: ModelEngine, mbs: Sequence[MicroBatch], vocab: int
) -> tuple[list[dict], list[MicroBatch]]:
    """The reference's forward (its logits) with its routers recorded; returns the outputs and
    the micro-batches carrying those routes (``ROUTES`` [1, t, layers, top_k]) for replay."""
    outputs = engine.run(mbs, keep_logits(vocab), forward_only=True, record_routes=True)
    rows = whole_rows(engine, mbs)
    routed = [
        dataclasses.replace(mb, fields={**mb.fields, ROUTES: row[None]})
        for mb, row in zip(mbs, rows, strict=True)
    ]
    return outputs, routed


def logit_diff(outputs: list[dict], reference: list[dict]) -> tuple[float, float]:
    """(max |logit - reference logit|, max(1, max |reference logit|)) over every position."""
    worst, scale = 0.0, 1.0
    for out, ref in zip(outputs, reference, strict=True):
        a, b = out["logits"], ref["logits"].to(out["logits"].device)
        worst = max(worst, (a - b).abs().max().item())
        scale = max(scale, b.abs().max().item())
    return worst, scale


def agreement(engine: ModelEngine) -> float:
    """The share of the given (replayed) experts the engine's own top-k also picked since the
    last call, on this rank; NaN when nothing was given."""
    hits, given = engine.router_replay.take_agreement().tolist()
    return hits / given if given else float("nan")


def hf_grads(engine: ModelEngine) -> dict[str, torch.Tensor]:
    """Every parameter's reduced gradient (``main_grad``) of this rank as full HF-named fp32
    tensors on the host (TP 1: a rank's tensors are whole; under EP its own experts, by
    their global names)."""
    out = {}
    chunks = model_chunks_of_rank(engine.config, engine.pp_rank, ep_rank=engine.groups.ep_rank)
    for model, chunk in zip(engine.chunks, chunks, strict=True):
        for name, param in chunk_parameters(model, engine.record, chunk).items():
            for hf_name, grad in engine.record.megatron_to_hf(name, [param.main_grad], chunk):
                out[hf_name] = grad.detach().to(HOST, torch.float32).clone()
    return out


def grad_diff(
    grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
) -> tuple[float, str, int]:
    """(largest relative difference, its tensor, tensors compared) of ``grads`` against the
    same names of ``reference`` (see GRAD_TOLERANCE); ValueError for a name the reference
    lacks, or for no gradient at all."""
    missing = sorted(set(grads) - set(reference))
    if missing or not grads:
        raise ValueError(f"gradients without a reference: {missing[:5]} (of {len(grads)})")
    floor = 1e-3 * max(reference[name].norm().item() for name in grads)
    worst, where = 0.0, ""
    for name, grad in grads.items():
        ref = reference[name]
        rel = (grad - ref).norm().item() / max(ref.norm().item(), floor, 1e-30)
        if rel >= worst:
            worst, where = rel, name
    return worst, where, len(grads)


def moe_modules(engine: ModelEngine) -> set[str]:
    """Class names of the MoE layers' experts and token dispatchers."""
    names = set()
    for chunk in engine.chunks:
        for module in chunk.modules():
            if type(module).__name__ == "MoELayer":
                names.add(type(module.experts).__name__)
                names.add(type(module.token_dispatcher).__name__)
    return names
