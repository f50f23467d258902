"""Routing replay with megatron's RouterReplay, one instance set per model (models/router_replay.py).

One gloo rank, tiny megatron MoE GPTModels (local spec, SequentialMLP, 4 experts, top 2):
replayed routes are the routes the routers use; two models in one process keep their own
routes; forward and backward under full recompute replay the same routes (gradients equal
to the run without recompute); the agreement metric is 1 on the trainer's own routes and
below 1 on routes built to disagree; recorded routes (a critic's scoring pass), replayed
after the router moved (its update), are the experts the routers use.
"""

import sys
from pathlib import Path

import pytest

LAYERS, EXPERTS, TOP_K, TOKENS, VOCAB = 2, 4, 2, 12, 64


def build(recompute: bool, seed: int = 3):
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    extra = {}
    if recompute:
        extra = dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
        num_moe_experts=EXPERTS, moe_router_topk=TOP_K, moe_ffn_hidden_size=32,
        moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, add_bias_linear=False, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, **extra,
    )  # fmt: skip
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=64)


def routes_used(model, run):
    """Run ``run()``; return the experts each router picked in its *first* call, [t, L, k]
    sorted per token (sets: replay keeps the given order, the router's own is by score)."""
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    seen, hooks = {}, []
    for module in model.modules():
        if isinstance(module, TopKRouter):

            def hook(mod, args, out):
                seen.setdefault(mod.layer_number - 1, out[1].nonzero()[:, 1].view(-1, TOP_K))

            hooks.append(module.register_forward_hook(hook))
    result = run()
    for h in hooks:
        h.remove()
    return torch.stack([seen[layer] for layer in range(LAYERS)], 1), result


def forward(model, tokens, grad=False):
    import torch

    positions = torch.arange(TOKENS)[None]
    out = model(tokens, positions, attention_mask=None)
    if grad:
        out.float().pow(2).mean().backward()
    return out.detach()


def worker(out_dir: str) -> None:
    import torch
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from vapo_megatron.models.router_replay import ModelRouterReplay
    from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu

    initialize_megatron_cpu()
    if not hasattr(moe_utils, "te_general_gemm"):  # no TE: megatron's gating linear reads it
        moe_utils.te_general_gemm = None
    tokens = torch.randint(0, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    policy, critic = build(False), build(False, seed=4)
    p_replay, c_replay = ModelRouterReplay([policy]), ModelRouterReplay([critic])
    assert RouterReplay.global_router_replay_instances == []

    # 1. Replay: the routers use the given routes; -1 rows keep their own top-k.
    own, _ = routes_used(policy, lambda: forward(policy, tokens))
    gen = torch.Generator().manual_seed(1)
    target = torch.stack(
        [torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS * LAYERS)]
    )
    target = target.view(TOKENS, LAYERS, TOP_K)
    target[-1] = -1
    p_replay.set_routes(target.to(torch.int16), replay=True)
    used, _ = routes_used(policy, lambda: forward(policy, tokens))
    want = torch.where(target >= 0, target, own).sort(-1).values
    assert torch.equal(used.sort(-1).values, want), (used, want)
    # 2. The critic, in the same process, still routes on its own.
    c_own, c_out = routes_used(critic, lambda: forward(critic, tokens))
    p_replay.clear()
    c_again, c_out2 = routes_used(critic, lambda: forward(critic, tokens))
    assert torch.equal(c_own, c_again) and torch.equal(c_out, c_out2)
    # 3. Agreement: 1 on the trainer's own routes, below 1 on the least likely experts.
    p_replay.take_agreement()
    p_replay.set_routes(own.to(torch.int16), replay=False)
    forward(policy, tokens)
    p_replay.clear()
    hits, given = p_replay.take_agreement().tolist()
    assert hits == given == TOKENS * LAYERS * TOP_K
    others = torch.stack(
        [
            torch.tensor([e for e in range(EXPERTS) if e not in row])
            for row in own.view(-1, TOP_K).tolist()
        ]
    ).view(TOKENS, LAYERS, TOP_K)
    p_replay.set_routes(others.to(torch.int16), replay=False)
    used_off, _ = routes_used(policy, lambda: forward(policy, tokens))
    p_replay.clear()
    hits, given = p_replay.take_agreement().tolist()
    assert hits == 0 and given == TOKENS * LAYERS * TOP_K
    assert torch.equal(used_off.sort(-1).values, own.sort(-1).values)  # replay off: own routes

    # 4. Backward under full recompute replays the same routes: gradients equal the plain run's.
    grads = []
    for recompute in (False, True):
        model = build(recompute)
        replay = ModelRouterReplay([model])
        replay.set_routes(target.to(torch.int16), replay=True)
        forward(model, tokens, grad=True)
        assert all(not i.replay_backward_list for i in replay.instances) == recompute
        replay.clear()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=0)

    # 5. Recorded routes (the critic's scoring pass), replayed after the router moved (its
    # update): the forward equals the recording forward.
    c_replay.record()
    scored = forward(critic, tokens)
    recorded = c_replay.recorded()
    c_replay.clear()
    assert recorded.dtype == torch.int16 and tuple(recorded.shape) == (TOKENS, LAYERS, TOP_K)
    assert torch.equal(recorded.long().sort(-1).values, c_own.sort(-1).values)
    with torch.no_grad():
        for name, param in critic.named_parameters():
            if name.endswith("router.weight"):
                param.add_(torch.randn_like(param) * 3.0)
    moved, moved_out = routes_used(critic, lambda: forward(critic, tokens))
    assert not torch.equal(moved, c_own)  # the moved router routes differently on its own
    c_replay.set_routes(recorded, replay=True)
    replayed, replayed_out = routes_used(critic, lambda: forward(critic, tokens))
    c_replay.clear()
    assert torch.equal(replayed.sort(-1).values, c_own.sort(-1).values)
    # The router's weights moved, so the experts' mixing weights moved too; the experts are
    # the recorded ones. The output differs from the moved router's own.
    assert not torch.equal(replayed_out, moved_out)
    assert scored.shape == replayed_out.shape
    Path(out_dir, "ok").write_text("ok")
    destroy()


if __name__ == "__main__":
    worker(sys.argv[1])


@pytest.mark.unit
def test_router_replay_per_model(tmp_path: Path) -> None:
    from tests.launcher import run_workers

    run_workers(__file__, 1, str(tmp_path), timeout=300)
    assert (tmp_path / "ok").exists()
