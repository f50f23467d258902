"""Parts: the policy's weights leaving Megatron (the weight stream into an HF model, whose
logits must equal Megatron's), and Transformer Engine's layer spec against the local one."""

from __future__ import annotations

import torch

from gpu_checks.context import Context
from gpu_checks.frame import Skipped, check
from gpu_checks.tiny import LOGIT_TOLERANCE, TOKEN_BUDGET
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.step.batching import FLAT_INDEX, build_samples, micro_batches
from vapo_megatron.step.losses import logprob_scoring_fn
from vapo_megatron.step.outputs import score_flat
from vapo_megatron.weights.stream import stream_plan, stream_policy_weights


def weight_stream(ctx: Context, numbers: dict) -> None:
    ctx.results.need("engines")
    policy = ctx.policy
    plan = stream_plan(policy.record, policy.config, pp_size=1)
    targets = model = None
    if ctx.transformers[0]:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config.from_pretrained(ctx.hf_dir)  # a local directory: no download
        # As from_pretrained(dtype=) builds it: RoPE's inv_freq stays fp32 (.to() would not).
        with torch.device(ctx.device):
            model = Qwen2ForCausalLM._from_config(config, dtype=ctx.dtype).eval()
        targets = dict(model.named_parameters())
    changed, count, num_bytes, devices = 0, 0, 0, set()
    with torch.no_grad():
        for bucket in stream_policy_weights(
            policy.chunks, policy.record, policy.config,
            tp_group=policy.groups.parallel.tp, pp_group=policy.groups.parallel.pp,
            bucket_bytes=1 << 20,
        ):  # fmt: skip
            for name, tensor in bucket:
                want_name, meta = plan[count]
                check(
                    (name, tuple(tensor.shape), tensor.dtype)
                    == (want_name, tuple(meta.shape), meta.dtype),
                    f"tensor {count}: {name} {tuple(tensor.shape)} {tensor.dtype}, plan says "
                    f"{want_name} {tuple(meta.shape)} {meta.dtype}",
                )
                count += 1
                num_bytes += tensor.numel() * tensor.element_size()
                devices.add(str(tensor.device))
                changed += not torch.equal(tensor.to(HOST), ctx.policy_tensors[name])
                if targets is not None:
                    check(name in targets, f"{name}: no such HF parameter (or sent twice)")
                    targets.pop(name).copy_(tensor)  # the in-process handoff
    numbers.update(tensors=count, mb=num_bytes / 1e6, changed=changed, devices=sorted(devices))
    check(count == len(plan), f"{count} tensors streamed, the plan has {len(plan)}")
    if ctx.results.passed("update_policy"):
        check(changed > 0, "the stream carries the weights from before the policy update")
    if targets is None:
        numbers["hf_model"] = "skipped: transformers not importable"
        return
    check(not targets, f"HF parameters the stream never set: {sorted(targets)}")
    ctx.hf_model = model


def hf_logits(ctx: Context, numbers: dict) -> None:
    if not ctx.transformers[0]:
        raise Skipped(
            f"transformers not importable ({ctx.transformers[1]})", missing="transformers"
        )
    ctx.results.need("weight_stream")
    policy, step = ctx.policy, ctx.step
    samples = build_samples(step.prompts, step.responses, range(len(step.prompts)), step.offsets)
    mbs = micro_batches(
        samples, policy.layout, cp_rank=policy.cp_rank, token_budget=TOKEN_BUDGET,
        field_names=[FLAT_INDEX],
    )  # fmt: skip

    def keep_logits(logits: torch.Tensor, mb):
        return logits.new_zeros((), dtype=torch.float32), {"logits": logits.detach().clone()}

    outputs = policy.run(mbs, keep_logits, forward_only=True)
    vocab = ctx.hf.vocab_size
    worst, scale, positions = 0.0, 1.0, 0
    with torch.no_grad():
        for mb, out in zip(mbs, outputs, strict=True):
            megatron = out["logits"][0, :, :vocab].float()  # [t, V] packed
            cu = mb.packed_seq_params.cu_seqlens_q_padded.tolist()
            lengths = mb.packed_seq_params.cu_seqlens_q.diff().tolist()
            for start, length in zip(cu[:-1], lengths, strict=True):
                tokens = mb.tokens[0, start : start + length].to(ctx.device).long()
                ref = ctx.hf_model(input_ids=tokens[None]).logits[0].float()
                mine = megatron[start : start + length].to(ctx.device)
                worst = max(worst, (ref - mine).abs().max().item())
                scale = max(scale, ref.abs().max().item())
                positions += length
    tolerance = LOGIT_TOLERANCE[ctx.dtype] * scale
    numbers.update(
        max_abs_diff=worst, tolerance=tolerance, max_abs_logit=scale, positions=positions,
        micro_batches=len(mbs),
    )  # fmt: skip
    check(worst <= tolerance, f"max |HF - Megatron| logit {worst:.3g} > {tolerance:.3g}")


def te_spec(ctx: Context, numbers: dict) -> None:
    if ctx.device.type != "cuda":
        raise Skipped("Transformer Engine runs on CUDA only (--cpu)")
    if not ctx.te[0]:
        raise Skipped(
            f"transformer_engine not importable ({ctx.te[1]})", missing="transformer_engine"
        )
    ctx.results.need("distributed", "engines", "scoring")
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    numbers["te_version"] = ctx.te[1]
    engine = ctx.engine("lm", ctx.policy_groups, get_gpt_layer_with_transformer_engine_spec())
    engine.load_hf(ctx.policy_tensors)  # the weights the scoring pass saw
    logprobs = score_flat(
        engine, ctx.step.prompts, ctx.step.responses, output_key="logprobs",
        token_budget=TOKEN_BUDGET,
        scoring_fn=logprob_scoring_fn(engine.vocab_slice, temperature=1.0),
    )  # fmt: skip
    old = ctx.old_logprobs.to(logprobs.device)
    worst = (logprobs - old).abs().max().item()
    scale = max(1.0, ctx.old_logprobs.abs().max().item())
    tolerance = LOGIT_TOLERANCE[ctx.dtype] * scale
    numbers.update(max_abs_logprob_diff=worst, tolerance=tolerance)
    check(worst <= tolerance, f"TE vs local log-probs differ by {worst:.3g} > {tolerance:.3g}")
