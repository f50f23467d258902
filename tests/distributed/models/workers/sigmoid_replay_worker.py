"""Worker: routing replay and the expert bias of a sigmoid router (tiny DeepSeek-V3 through the
production ModelEngine, one gloo rank; ``test_sigmoid_replay.py`` says what is checked).

Usage: python sigmoid_replay_worker.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tests.distributed.models.workers.qwen3_parity_worker import checkpoint_tensors
from tests.distributed.models.workers.sigmoid_moe_parity_worker import tiny_config
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.moe import MoESettings
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.data.packing import Sample, pack
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.cpu_shim import initialize_megatron_cpu

TOKENS = 24


def hf_weights():
    config = tiny_config("deepseek_v3")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    for layer in model.model.layers[config.first_k_dense_replace :]:
        layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(config.n_routed_experts) * 0.05)
    return HFModelConfig.from_hf(config.to_dict()), checkpoint_tensors(model)


def engine_of(hf, weights, rate: float) -> ModelEngine:
    moe = MoESettings(router_bias_update_rate=rate)
    engine = ModelEngine(hf, ModelLayout(), head="lm", optim=OptimSettings(), moe=moe)
    engine.load_hf(weights)
    return engine


def router_calls(engine, run):
    """(layer, logits, probs [t, E], routing_map [t, E]) of every router call in ``run()``."""
    calls, hooks = [], []
    for router in engine.router_replay.routers:

        def hook(mod, args, out):
            logits = torch.nn.functional.linear(args[0].reshape(-1, args[0].shape[-1]), mod.weight)
            calls.append((mod.layer_number - 1, logits.detach(), out[0].detach(), out[1]))

        hooks.append(router.register_forward_hook(hook))
    result = run()
    for h in hooks:
        h.remove()
    return calls, result


def check_replay(engine, hf) -> dict:
    """Forced experts are the ones used; their weights are the current unbiased sigmoid scores,
    renormalised and scaled; the router gets gradients; without replay the bias changes the
    choice (so a replay that kept the engine's bias-free top-k would be caught)."""
    replay = engine.router_replay
    assert replay.layers == [1, 2, 3], replay.layers  # the dense layer 0 has no router
    gen = torch.Generator().manual_seed(2)
    forced = torch.stack(
        [torch.randperm(hf.num_experts, generator=gen)[: hf.moe_top_k] for _ in range(TOKENS * 3)]
    ).view(TOKENS, 3, hf.moe_top_k)
    tokens = torch.randint(0, hf.vocab_size, (1, TOKENS), generator=gen)
    positions = torch.arange(TOKENS)[None]
    model = engine.chunks[0]

    def forward():
        replay.set_routes(forced, replay=True)
        out = model(tokens, positions, attention_mask=None)
        out.float().pow(2).mean().backward()
        replay.clear()

    calls, _ = router_calls(engine, forward)
    worst = 0.0
    for layer, logits, probs, routing_map in calls:
        want = forced[:, layer - 1]
        picked = routing_map.nonzero()[:, 1].view(TOKENS, -1)
        assert torch.equal(picked.sort(-1).values, want.sort(-1).values), layer
        scores = torch.sigmoid(logits.float()).gather(1, want)
        weights = scores / scores.sum(-1, keepdim=True) * hf.routed_scaling_factor
        worst = max(worst, (probs.gather(1, want) - weights).abs().max().item())
    assert worst < 1e-6, worst
    router_grads = [r.weight.main_grad.abs().sum().item() for r in replay.routers]
    assert all(g > 0 for g in router_grads), router_grads

    router = replay.routers[0]
    x = torch.randn(200, hf.hidden_size, generator=gen)
    with torch.no_grad():
        own = router(x.view(200, 1, -1))[1].nonzero()[:, 1].view(200, -1).sort(-1).values
        bias, router.expert_bias = router.expert_bias.clone(), torch.zeros_like(router.expert_bias)
        unbiased = router(x.view(200, 1, -1))[1].nonzero()[:, 1].view(200, -1).sort(-1).values
        router.expert_bias = bias
    differ = (own != unbiased).any(-1).float().mean().item()
    assert differ > 0, "the expert bias changed no choice: the test cannot see it"
    return {"replay_weight_max_diff": worst, "bias_changes_choice": differ}


def bias_after_a_step(engine, hf) -> torch.Tensor:
    samples = [Sample(list(range(3, 9)), list(range(9, 17))), Sample([5, 6, 7], [8, 9, 10, 11])]
    mbs = [pack(samples, cp_size=1, cp_rank=0, pad_multiple=8)]
    engine.run(mbs, lambda out, mb: (out.float().pow(2).mean(), {}))
    engine.step()
    return torch.stack([r.expert_bias.clone() for r in engine.router_replay.routers])


def main(out_dir: str) -> None:
    initialize_megatron_cpu()
    hf, weights = hf_weights()
    frozen = engine_of(hf, weights, rate=0.0)
    frozen.track_routes(replay=True)
    numbers = check_replay(frozen, hf)
    loaded = torch.stack(
        [weights[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] for i in (1, 2, 3)]
    )
    assert torch.equal(bias_after_a_step(frozen, hf), loaded)  # rate 0: frozen
    moving = engine_of(hf, weights, rate=1e-3)
    moving.track_routes(replay=False)
    moved = bias_after_a_step(moving, hf) - loaded
    steps = moved.abs()  # megatron's sign update: +-rate, 0 only for an exactly average load
    assert ((steps < 1e-7) | ((steps - 1e-3).abs() < 1e-6)).all(), moved
    assert (steps > 0).float().mean() > 0.5, moved
    numbers["bias_step_with_rate_1e-3"] = steps.max().item()
    Path(out_dir, "numbers.json").write_text(json.dumps(numbers))
    print(json.dumps(numbers))


if __name__ == "__main__":
    main(sys.argv[1])
