"""Worker: one training step of a tiny Qwen3-MoE policy at EP1, EP2 and EP2 x TP2 (2 ranks);
with ``deepseek_v3``, a tiny DeepSeek-V3 (MLA, a dense first layer, a shared expert, sigmoid
routing with a non-zero expert bias) at EP1, TP2 and EP2 x TP2, the plain optimizer only.

Usage: python moe_ep_step_worker.py OUT.pt [qwen3_moe|deepseek_v3]. Every layout trains the same HF weights on the same
mini-batch through the trainer's own path (``ModelEngine`` + ``step/updates.py::train_on``:
DP shares, token-budget micro-batches, global loss normalisers, megatron's DDP and Adam):

- ``ep1``: DP 2, experts replicated (their gradients reduced over DP like any weight);
- ``ep2``: DP 2, EP 2 (expert DP 1): tokens cross ranks in the all-to-all dispatcher, the
  experts' gradients are reduced over the expert-DP group (megatron's expert buffers);
- ``ep2xtp2``: TP 2 with sequence parallelism, EP 2, expert TP 1 (DP 1: the whole mini-batch
  on one data-parallel rank).

Each layout runs twice: with megatron's plain optimizer, where the reduced gradients
(``main_grad`` after ``finalize_model_grads``) are read just before Adam's step and gathered to
full HF-named tensors by the record, as weights are; and with the distributed optimizer (Adam
state sharded over DP, experts' over expert DP), weights only. Rank 0 saves, per run, the
gradients, the updated weights and the step's metrics; ``tests/distributed/models/
test_moe_ep_step.py`` compares them.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from tests.distributed.models.workers.qwen3_parity_worker import checkpoint_tensors
from vapo_megatron.algorithms.presets import algo_preset
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.data.packing import Sample
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.cpu_shim import initialize_cpu_process_group
from vapo_megatron.parallel.model_groups import build_model_groups, ensure_global_memory_buffer
from vapo_megatron.step.batching import FLAT_INDEX
from vapo_megatron.step.losses import policy_loss_fn
from vapo_megatron.step.updates import train_on
from vapo_megatron.tiny.model import tiny_deepseek_v3_config, tiny_qwen3_config, train_tokenizer

# (layout, build_model_groups sizes) on 2 ranks.
LAYOUTS = {
    "ep1": (ModelLayout(), dict(tp=1, ep=1)),
    "ep2": (ModelLayout(ep=2), dict(tp=1, ep=2)),
    "ep2xtp2": (ModelLayout(tp=2, ep=2, etp=1, sequence_parallel=True), dict(tp=2, ep=2, etp=1)),
    "tp2": (ModelLayout(tp=2, sequence_parallel=True), dict(tp=2, ep=1)),
}
RUNS = {
    "qwen3_moe": [(n, d) for n in ("ep1", "ep2", "ep2xtp2") for d in (False, True)],
    "deepseek_v3": [(n, False) for n in ("ep1", "tp2", "ep2xtp2")],
}
"""(layout, distributed optimizer) of each family's runs."""
# Adam's first step moves each weight by lr * g / (|g| + eps), whose slope in g is at most
# 1 / eps: eps = lr keeps a gradient's rounding-level difference between layouts at the same
# size in the weights (the project's default eps = 1e-8 would amplify it up to +-lr; the test's
# docstring has the numbers). Clipping at 1 is active (the gradient norm is ~2.3).
OPTIM = OptimSettings(lr=1e-3, weight_decay=0.0, adam_eps=1e-3, clip_grad=1.0)
ALGO = algo_preset("vapo", critic_init="policy")
FIELDS = [FLAT_INDEX, "old_logprobs", "advantages", "positive", "seq_num_tokens"]
TOKEN_BUDGET = 32  # several micro-batches on each data-parallel rank


def reference(family: str = "qwen3_moe") -> tuple[HFModelConfig, dict[str, torch.Tensor], int]:
    """The tiny model's config, HF weights (the same on every rank) and vocabulary size."""
    tokenizer = train_tokenizer(["12+34=46", "Answer: 46", "7*8=56 and 9-3=6"], vocab_size=300)
    if family == "deepseek_v3":
        config = tiny_deepseek_v3_config(tokenizer, num_layers=3)
    else:
        config = tiny_qwen3_config(tokenizer, moe=True, num_layers=2)
    config.initializer_range = 0.1  # router logits far apart: no near-ties in the top-k
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config).float()
    if family == "deepseek_v3":  # a bias that changes the choice, not the weights
        for layer in policy.model.layers[config.first_k_dense_replace :]:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(torch.randn(bias.shape) * 0.05)
    return HFModelConfig.from_hf(config.to_dict()), checkpoint_tensors(policy), config.vocab_size


def samples(vocab: int) -> list[Sample]:
    """9 samples of random tokens, none of them the tokenizer's special ids 0 (eos) and 1
    (pad): transformers zeroes the pad token's embedding row (``padding_idx``), and RMSNorm's
    gradient at a zero input is 1 / sqrt(eps) = 1000 times its output gradient, so one pad
    token would make that row's gradient 1000 times every other (transformers never sees it:
    ``padding_idx`` rows get no gradient) and the gradient norm, hence the clipping, would be
    that row alone."""
    gen = torch.Generator().manual_seed(3)
    out, offset = [], 0
    for i in range(9):  # odd: the DP shares differ in size
        n_prompt, n_resp = 2 + i % 4, 3 + (7 * i) % 9
        prompt = torch.randint(2, vocab, (n_prompt,), generator=gen).tolist()
        response = torch.randint(2, vocab, (n_resp,), generator=gen).tolist()
        fields = {
            FLAT_INDEX: torch.arange(offset, offset + n_resp),
            "old_logprobs": -5.8 + 0.1 * torch.randn(n_resp, generator=gen),
            "advantages": torch.randn(n_resp, generator=gen),
            "positive": torch.full((n_resp,), i % 3 == 0),
            "seq_num_tokens": torch.full((n_resp,), float(n_resp)),
        }
        offset += n_resp
        out.append(Sample(prompt, response, fields))
    return out


def reduced_gradients(engine: ModelEngine) -> dict[str, torch.Tensor]:
    """Every parameter's reduced gradient (its ``main_grad``, what Adam reads), as full
    HF-named tensors: each parameter's data is pointed at its gradient for the record's gather
    over TP and EP (collective), then pointed back."""
    params = [p for chunk in engine.chunks for p in chunk.parameters()]
    weights = [p.data for p in params]
    for p in params:
        p.data = p.main_grad
    try:
        return {name: t.clone() for name, t in engine.hf_weights()}
    finally:
        for p, w in zip(params, weights, strict=True):
            p.data = w


def one_step(name: str, hf, sd, vocab: int, *, distributed_optimizer: bool) -> dict:
    layout, sizes = LAYOUTS[name]
    groups = build_model_groups(pp=1, cp=1, **sizes)
    optim = OptimSettings(**{**OPTIM.__dict__, "distributed_optimizer": distributed_optimizer})
    engine = ModelEngine(hf, layout, head="lm", optim=optim, groups=groups)
    engine.load_hf(sd)
    found: dict = {}
    if not distributed_optimizer:  # the plain optimizer's main_grad is whole on every rank
        step = engine.step

        def step_after_reading_gradients():
            found["grads"] = reduced_gradients(engine)
            return step()

        engine.step = step_after_reading_gradients
    vocab_slice = engine.vocab_slice
    metrics = train_on(
        engine,
        samples(vocab),
        lambda norm: policy_loss_fn(ALGO, norm, vocab_slice),
        field_names=FIELDS,
        token_budget=TOKEN_BUDGET,
    )
    found["weights"] = dict(engine.hf_weights())
    found["metrics"] = {k: float(v) for k, v in metrics.items()}
    return found


def main(out: str, family: str = "qwen3_moe") -> None:
    initialize_cpu_process_group()
    ensure_global_memory_buffer()
    hf, sd, vocab = reference(family)
    results = {"initial": sd}
    for name, dist_opt in RUNS[family]:
        found = one_step(name, hf, sd, vocab, distributed_optimizer=dist_opt)
        results[f"{name}/{'distopt' if dist_opt else 'plain'}"] = found
        print(f"rank {dist.get_rank()}: {name} distopt={dist_opt}: {found['metrics']}")
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
