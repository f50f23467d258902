"""Parts: the process groups, the engines, and one step of the flat path (world 1): the
scoring pass, advantages, and one update of each model."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from gpu_checks import twin
from gpu_checks.compare import max_change, param_snapshot
from gpu_checks.context import Context
from gpu_checks.frame import check
from gpu_checks.tiny import SEED, TOKEN_BUDGET, random_hf_tensors, write_hf_dir
from vapo_megatron.models.provider import default_layer_spec, layer_spec_kind, local_spec
from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.parallel.model_groups import (
    build_model_groups,
    ensure_global_memory_buffer,
    seed_rng_tracker,
)
from vapo_megatron.step import advantages as adv
from vapo_megatron.step.advantage_exchange import OwnerPath
from vapo_megatron.step.losses import logprob_scoring_fn, value_scoring_fn
from vapo_megatron.step.outputs import PathChoice, StepModels, TokenFields, score_flat
from vapo_megatron.step.scoring_pass import step_share
from vapo_megatron.step.token_sums import TokenSums
from vapo_megatron.step.updates import UpdateData, update_minibatch
from vapo_megatron.trainer.session import init_distributed
from vapo_megatron.weights import hf_io
from vapo_megatron.weights.critic import critic_from_policy


def distributed(ctx: Context, numbers: dict) -> None:
    init_distributed()
    backend = dist.get_backend()
    numbers["backend"] = backend
    cuda = ctx.device.type == "cuda"
    check(backend == ("nccl" if cuda else "gloo"), f"backend {backend} on {ctx.device}")
    if cuda:
        current = torch.device("cuda", torch.cuda.current_device())
        check(current == ctx.device, f"current device {current}, expected {ctx.device}")
    x = torch.full((4,), 2.0, device=ctx.device)
    dist.all_reduce(x)
    check(torch.equal(x, torch.full((4,), 2.0, device=ctx.device)), f"all_reduce gave {x}")
    ctx.host = collectives.make_host_group()  # as Session makes it: one per job
    if ctx.twin:
        twin.install([ctx.host])
    ctx.policy_groups = build_model_groups(tp=1, pp=1, cp=1, host=ctx.host)
    ctx.critic_groups = build_model_groups(tp=1, pp=1, cp=1, host=ctx.host)
    ensure_global_memory_buffer()
    seed_rng_tracker(ctx.policy_groups, seed=SEED)
    read = twin.backends_as_read(ctx.host)
    read["model"] = collectives.group_backend(ctx.policy_groups.parallel.dp_cp)
    numbers["collectives_read"] = read
    numbers["world_size"] = dist.get_world_size()
    want = {"default": "nccl", "host": "gloo", "model": "nccl"}
    check(read == want, f"collectives read the groups as {read}, as on a GPU: {want}")


def default_layer_spec_part(ctx: Context, numbers: dict) -> None:
    spec = default_layer_spec()
    numbers["kind"] = layer_spec_kind(spec)
    expected = "te" if ctx.te[0] and ctx.device.type == "cuda" else "local"
    numbers["expected"] = expected
    check(numbers["kind"] == expected, f"the trainer builds with {numbers['kind']!r}")
    if expected == "local":
        check(spec == local_spec(), f"not the local spec the other parts use: {spec}")


def engines(ctx: Context, numbers: dict) -> None:
    ctx.results.need("distributed")
    write_hf_dir(ctx.hf_dir, random_hf_tensors(ctx.hf, ctx.dtype), ctx.dtype)
    source = hf_io.HFCheckpoint(ctx.hf_dir)  # as Session reads model.path
    ctx.policy_tensors = dict(source.read(source.names))
    ctx.policy = ctx.engine("lm", ctx.policy_groups)
    ctx.policy.load_hf(ctx.policy_tensors)
    ctx.critic = ctx.engine("value", ctx.critic_groups)
    ctx.critic.load_hf(critic_from_policy(ctx.policy_tensors, ctx.hf, 0.1, SEED))
    for name, engine in (("policy", ctx.policy), ("critic", ctx.critic)):
        params = [p for chunk in engine.chunks for p in chunk.parameters()]
        numbers[f"{name}_params"] = sum(p.numel() for p in params)
        where = {str(p.device) for p in params} | {str(p.dtype) for p in params}
        want = {str(ctx.device), str(ctx.dtype)}
        check(where == want, f"{name} parameters on/in {sorted(where)}, want {sorted(want)}")
        check(engine.device == ctx.device, f"{name} engine.device is {engine.device}")


def scoring(ctx: Context, numbers: dict) -> None:
    ctx.results.need("engines")
    step = ctx.step
    logprobs = score_flat(
        ctx.policy, step.prompts, step.responses, output_key="logprobs",
        token_budget=TOKEN_BUDGET,
        scoring_fn=logprob_scoring_fn(ctx.policy.vocab_slice, temperature=1.0),
    )  # fmt: skip
    values = score_flat(
        ctx.critic, step.prompts, step.responses, output_key="values",
        token_budget=TOKEN_BUDGET, scoring_fn=value_scoring_fn(),
    )  # fmt: skip
    total = step.num_tokens
    numbers.update(
        tokens=total, out_device=str(logprobs.device),
        mean_logprob=logprobs.double().mean().item(), mean_value=values.double().mean().item(),
    )  # fmt: skip
    for name, out in (("logprobs", logprobs), ("values", values)):
        check(out.shape == (total,), f"{name} shape {tuple(out.shape)}, want ({total},)")
        check(bool(torch.isfinite(out).all()), f"{name} not finite")
    check(bool((logprobs <= 1e-4).all()), f"log-probs above 0: {logprobs.max().item()}")
    ctx.old_logprobs, ctx.values = logprobs, values


def flat_update_data(ctx: Context, numbers: dict) -> UpdateData:
    """The step's update inputs on one GPU (one DP rank holds the whole step, in flat order):
    old log-probs and values from the scoring part (placeholders if it failed, so the
    updates still run), advantages and returns over the step's tokens."""
    step = ctx.step
    values, old_logprobs = ctx.values, ctx.old_logprobs
    if values is None or old_logprobs is None:
        numbers["inputs"] = "placeholders (scoring did not pass)"
        values = torch.zeros(step.num_tokens, dtype=torch.float32, device=HOST)
        old_logprobs = torch.full(
            (step.num_tokens,), -math.log(ctx.hf.vocab_size), dtype=torch.float32, device=HOST
        )
    rewards = torch.tensor(step.rewards, dtype=torch.float32, device=HOST)
    offsets = step.offsets
    advantages, returns, _ = adv.gae_advantages(ctx.algo, rewards, values, offsets)
    arrays = {
        "old_logprobs": old_logprobs, "old_values": values,
        "advantages": adv.whiten(advantages, TokenSums(None, None)), "returns": returns,
    }  # fmt: skip
    prompts, responses = step.ragged()
    everything = torch.arange(len(step.rewards), dtype=torch.long, device=HOST)
    share = step_share([everything], step.token_counts(), responses.lengths(), dp_size=1, dp_rank=0)
    return UpdateData(
        prompts=prompts, responses=responses,
        fields=TokenFields(offsets[:-1].tolist(), arrays),
        positive=[reward > 0 for reward in step.rewards],
        trainable_policy=[True] * len(step.rewards),
        path=OwnerPath(
            StepModels(ctx.policy, ctx.critic), {"policy": share, "critic": share}, None,
            path=PathChoice("shards", "one GPU: one DP rank holds every sample"),
        ),
    )  # fmt: skip


def update_critic(ctx: Context, numbers: dict) -> None:
    ctx.results.need("engines")
    before = param_snapshot(ctx.critic)
    metrics, _ = update_minibatch(
        flat_update_data(ctx, numbers), list(range(len(ctx.step.rewards))), algo=ctx.algo,
        policy=None, critic=ctx.critic, temperature=1.0, token_budget=TOKEN_BUDGET,
    )  # fmt: skip
    update_numbers(numbers, metrics, "value_loss", before, ctx.critic)
    if "inputs" not in numbers:
        ctx.update_metrics["critic"] = metrics


def update_policy(ctx: Context, numbers: dict) -> None:
    ctx.results.need("engines")
    before = param_snapshot(ctx.policy)
    _, metrics = update_minibatch(
        flat_update_data(ctx, numbers), list(range(len(ctx.step.rewards))), algo=ctx.algo,
        policy=ctx.policy, critic=None, temperature=1.0, token_budget=TOKEN_BUDGET,
    )  # fmt: skip
    update_numbers(numbers, metrics, "pg_loss", before, ctx.policy)
    if "entropy" in metrics:
        numbers["entropy"] = metrics["entropy"]
    if "inputs" not in numbers:
        ctx.update_metrics["policy"] = metrics


def update_numbers(numbers: dict, metrics: dict, loss_key: str, before, engine) -> None:
    """Loss, grad norm, tokens and the largest weight change of one update, checked."""
    numbers.update(
        loss=metrics.get(loss_key, float("nan")), grad_norm=metrics["grad_norm"],
        tokens=metrics["num_tokens"], max_weight_change=max_change(before, engine),
    )  # fmt: skip
    check(loss_key in metrics, f"no {loss_key} in the metrics {sorted(metrics)}")
    check(math.isfinite(metrics[loss_key]), f"{loss_key} not finite")
    grad_norm = metrics["grad_norm"]
    check(0 < grad_norm < float("inf"), f"grad norm {grad_norm}")
    check(numbers["max_weight_change"] > 0, "the update left every weight unchanged")
