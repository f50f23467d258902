"""Part ``moe``: a tiny Qwen3-MoE policy and critic on the device with routing replay.

What a GPU shows that the CPU tests cannot: megatron's MoE layer (router, all-to-all token
dispatcher, SequentialMLP experts of the local spec) on CUDA tensors without the CPU shim
(``parallel/moe_cpu_shim.py`` is applied on CPU only), q/k norms, and the project's
``RouterReplay`` with device tensors:

1. the critic's scoring pass records its routes (``scoring_pass.score_share`` with
   ``critic.routing_replay``), cut into whole samples on the host (``step/critic_routes.py``);
2. the policy replays those routes as engine routes (``ModelEngine.run`` with the ``ROUTES``
   field): every router call of its scoring forward uses exactly the given experts;
3. one critic update on micro-batches packed otherwise replays its own routes in the forward
   and in the backward recompute (full recompute): every call uses the recorded experts,
   the loss and grad norm are finite and the weights move.
"""

from __future__ import annotations

import math

import torch

from gpu_checks.compare import max_change, param_snapshot
from gpu_checks.context import Context
from gpu_checks.frame import check
from gpu_checks.tiny import MOE_CONFIG, OPTIM, SEED, TOKEN_BUDGET, random_hf_tensors
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.recompute import RecomputeSettings
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.models.provider import local_spec
from vapo_megatron.parallel.model_groups import build_model_groups
from vapo_megatron.step.batching import ROUTES, build_samples, micro_batches
from vapo_megatron.step.critic_routes import step_routes
from vapo_megatron.step.losses import logprob_scoring_fn, value_scoring_fn
from vapo_megatron.step.outputs import StepInputs
from vapo_megatron.step.scoring_pass import ScoringPass, score_share, step_share
from vapo_megatron.weights.critic import critic_from_policy


def moe_hf_tensors(hf: HFModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tiny MoE's HF tensors (seeded: the same in every process), routers scaled up:
    wide router logits leave no near-ties between experts in bf16."""
    tensors = random_hf_tensors(hf, dtype)
    with torch.no_grad():
        for name, tensor in tensors.items():
            if name.endswith("mlp.gate.weight"):
                tensor.mul_(20.0)
    return tensors


def router_calls(engine: ModelEngine, run) -> dict[int, list[torch.Tensor]]:
    """Each router call's experts (sorted, on the host) per global layer during ``run()``."""
    calls: dict[int, list[torch.Tensor]] = {}
    hooks = []
    for router in engine.router_replay.routers:

        def hook(mod, args, out):
            picked = out[1].nonzero()[:, 1].view(out[1].shape[0], -1).cpu()
            calls.setdefault(mod.layer_number - 1, []).append(picked)

        hooks.append(router.register_forward_hook(hook))
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return calls


def check_used(calls: dict[int, list[torch.Tensor]], mbs, forwards: int, what: str) -> int:
    """Every call used its micro-batch's routes (in schedule order); returns the calls."""
    count = 0
    for layer, picks in calls.items():
        check(len(picks) == len(mbs) * forwards, f"{what}: layer {layer} ran {len(picks)} times")
        for k, picked in enumerate(picks):
            want = mbs[k // forwards].fields[ROUTES][0, :, layer].long()
            given = (want >= 0).all(-1)
            same = torch.equal(picked[given], want[given].sort(-1).values)
            check(same, f"{what}: layer {layer} call {k} used other experts than given")
            count += 1
    return count


def moe(ctx: Context, numbers: dict) -> None:
    ctx.results.need("distributed")
    hf = HFModelConfig.from_hf(MOE_CONFIG)
    policy_tensors = moe_hf_tensors(hf, ctx.dtype)
    recompute = RecomputeSettings(granularity="full", method="uniform", num_layers=1)
    engines = {}
    for head in ("lm", "value"):
        groups = build_model_groups(tp=1, pp=1, cp=1, host=ctx.host)
        engines[head] = ModelEngine(
            hf, ModelLayout(), head=head, groups=groups, params_dtype=ctx.dtype,
            layer_spec=local_spec(hf), optim=OPTIM, recompute=recompute,
        )  # fmt: skip
    policy, critic = engines["lm"], engines["value"]
    policy.load_hf(policy_tensors)
    critic.load_hf(critic_from_policy(policy_tensors, hf, 0.1, SEED))
    policy.track_routes(replay=True)
    critic.track_routes(replay=True)
    params = [p for e in engines.values() for chunk in e.chunks for p in chunk.parameters()]
    check({p.device for p in params} == {ctx.device}, "MoE parameters off the device")

    # 1. The critic's scoring pass records its routes.
    step = ctx.step
    prompts, responses = step.ragged()
    count = len(step.rewards)
    share = step_share(
        [torch.arange(count)], step.token_counts(), responses.lengths(), dp_size=1, dp_rank=0
    )
    rewards = torch.tensor(step.rewards, dtype=torch.float32)
    side = score_share(
        [ScoringPass("old_values", critic, value_scoring_fn(), "values")], share,
        StepInputs(prompts, responses, rewards, None), token_budget=TOKEN_BUDGET,
        host_group=ctx.host,
    )  # fmt: skip
    check(sorted(side.routes) == list(range(count)), f"routes kept for {sorted(side.routes)}")
    layers, top_k = hf.num_layers, hf.moe_top_k
    for i, routes in side.routes.items():
        want = (step.token_counts()[i], layers, top_k)
        check(tuple(routes.shape) == want, f"sample {i} routes {tuple(routes.shape)}")
        check(bool((routes >= 0).all()), f"sample {i}: a token without recorded experts")
        check(bool((routes < hf.num_experts).all()), f"sample {i}: expert id out of range")
    values = side.arrays["old_values"]
    check(bool(torch.isfinite(values).all()), "critic values not finite")
    kept = step_routes(side.routes, count, (layers, top_k))

    # 2. The policy replays them as engine routes in its scoring forward.
    order = list(range(count))[::-1]
    samples = build_samples(prompts, responses, order, responses.offsets, routes=kept)
    mbs = micro_batches(samples, policy.layout, cp_rank=0, token_budget=48, field_names=[])
    scoring = logprob_scoring_fn(policy.vocab_slice, temperature=1.0)
    calls = router_calls(policy, lambda: policy.run(mbs, scoring, forward_only=True))
    numbers["policy_router_calls"] = check_used(calls, mbs, 1, "policy scoring")

    # 3. A critic update replays its scoring routes, forward and backward recompute.
    before = param_snapshot(critic)

    def loss(out, mb):
        mask = mb.response_mask.to(out.device)
        return (out[..., 0].float() * mask).sum() / 100.0, {}

    calls = router_calls(critic, lambda: critic.run(mbs, loss))
    numbers["critic_router_calls"] = check_used(calls, mbs, 2, "critic update")
    metrics = critic.step()
    numbers.update(
        micro_batches=len(mbs), grad_norm=metrics["grad_norm"],
        max_weight_change=max_change(before, critic),
    )  # fmt: skip
    check(math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0, "critic grad norm")
    check(numbers["max_weight_change"] > 0, "the critic update left every weight unchanged")
