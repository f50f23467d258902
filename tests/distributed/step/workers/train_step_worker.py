"""Worker: one VAPO optimizer step of the policy and the critic at TP2, PP2, CP2 and DP2
(distributed optimizer) equals the same step in plain transformers + torch on one process.

Every rank computes the single-process reference itself (transformers model, the same loss
functions on full-vocabulary logits, torch AdamW with the same clipping), then trains the
Megatron engine at each layout from the same HF weights and compares: the summed loss, the
critic's values, and every updated weight (gathered back to HF names).
"""

from __future__ import annotations

import sys

import torch
from megatron.core import parallel_state as ps
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Model

from vapo_megatron.algorithms.presets import algo_preset
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.data.packing import Sample, pack, pad
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.models.logprobs import VocabSlice
from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu
from vapo_megatron.parallel.reductions import global_loss_normalisers
from vapo_megatron.step.losses import policy_loss_fn, value_loss_fn, value_scoring_fn

VOCAB = 250
OPTIM = OptimSettings(lr=1e-3, weight_decay=0.0, adam_eps=1e-6, clip_grad=0.5)
CFG = algo_preset("vapo", entropy_coef=0.01, value_clip=0.5)
HF_CONFIG = Qwen2Config(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, num_hidden_layers=4, vocab_size=VOCAB, max_position_embeddings=256,
    rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
)  # fmt: skip


def make_weights():
    torch.manual_seed(0)
    policy = Qwen2ForCausalLM(HF_CONFIG).float()
    policy_sd = {k: v.clone() for k, v in policy.state_dict().items()}
    critic_sd = {k: v for k, v in policy_sd.items() if k != "lm_head.weight"}
    critic_sd["score.weight"] = torch.randn(1, HF_CONFIG.hidden_size) * 0.1
    return policy_sd, critic_sd


def make_samples(policy_sd):
    gen = torch.Generator().manual_seed(1)
    shapes = [(3, 7), (5, 2), (4, 9), (6, 5), (2, 8), (3, 3), (5, 6), (4, 4)]
    samples = []
    for n_prompt, n_resp in shapes:
        prompt = torch.randint(0, VOCAB, (n_prompt,), generator=gen).tolist()
        response = torch.randint(0, VOCAB, (n_resp,), generator=gen).tolist()
        fields = {
            "advantages": torch.randn(n_resp, generator=gen),
            "returns": torch.randn(n_resp, generator=gen),
            "old_values": torch.randn(n_resp, generator=gen) * 0.1,
            "positive": torch.full((n_resp,), bool(torch.rand(1, generator=gen) > 0.5)),
            "seq_num_tokens": torch.full((n_resp,), float(n_resp)),
        }
        samples.append(Sample(prompt, response, fields))
    # Old log-probs near the model's own, so some ratios fall outside the clip range.
    mb = pad(samples)
    model = hf_policy(policy_sd)
    with torch.no_grad():
        logits = model(mb.tokens, attention_mask=attention_mask(samples, mb)).logits
        logp = torch.log_softmax(logits, -1).gather(-1, mb.labels[..., None]).squeeze(-1)
    for b, sample in enumerate(samples):
        start = len(sample.prompt) - 1
        old = logp[b, start : start + len(sample.response)]
        sample.fields["old_logprobs"] = old + 0.3 * torch.randn(old.shape, generator=gen)
    return samples


def attention_mask(samples, mb):
    lengths = torch.tensor([len(s.prompt) + len(s.response) for s in samples])
    return (torch.arange(mb.tokens.shape[1])[None] < lengths[:, None]).long()


def hf_policy(sd):
    model = Qwen2ForCausalLM(HF_CONFIG).float()
    model.load_state_dict(sd)
    return model


class HFCritic(torch.nn.Module):
    def __init__(self, sd):
        super().__init__()
        self.model = Qwen2Model(HF_CONFIG).float()
        self.score = torch.nn.Linear(HF_CONFIG.hidden_size, 1, bias=False)
        self.load_state_dict(sd)

    def forward(self, tokens, mask):
        return self.score(self.model(tokens, attention_mask=mask).last_hidden_state)


def reference_step(model, forward, loss_fn_factory, samples):
    """One step on one process: loss on the whole batch, clip, AdamW.

    Returns the gradient norm before clipping (Adam's update is blind to a wrong gradient
    scale; the norm is not), the model's outputs and the updated weights."""
    mb = pad(samples)
    norm = global_loss_normalisers(
        [mb.response_mask],
        [mb.fields["positive"]],
        len(samples),
        dp_cp_group=None,
        cp_size=1,
        device=torch.device("cpu"),
    )
    output = forward(model, mb, attention_mask(samples, mb))
    loss, _ = loss_fn_factory(norm)(output, mb)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.clip_grad)
    opt = torch.optim.AdamW(
        model.parameters(), lr=OPTIM.lr, betas=(OPTIM.adam_beta1, OPTIM.adam_beta2),
        eps=OPTIM.adam_eps, weight_decay=0.0,
    )  # fmt: skip
    opt.step()
    return (
        grad_norm.item(),
        output.detach(),
        {k: v.detach().clone() for k, v in model.state_dict().items()},
    )


ONE_PROCESS_VOCAB = VocabSlice(None, VOCAB)


def policy_factory(vocab=ONE_PROCESS_VOCAB):
    return lambda norm: policy_loss_fn(CFG, norm, vocab)


def critic_factory():
    return lambda norm: value_loss_fn(CFG, norm)


def check_layout(name, layout, micro, packed, distributed_optimizer, refs, samples, hf_sds):
    groups = initialize_megatron_cpu(tp=layout.tp, pp=layout.pp, cp=layout.cp, vpp=layout.vpp)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    cp_rank = ps.get_context_parallel_rank()
    mine = samples[dp_rank * len(samples) // dp : (dp_rank + 1) * len(samples) // dp]
    per = len(mine) // micro
    make = pack if packed else pad
    # Under PP every micro-batch needs one shape: pad_multiple=16 rounds all to 16 tokens;
    # sequence parallelism needs rows that divide by TP.
    multiple = 16 if layout.pp > 1 else (layout.tp if layout.sequence_parallel else 1)
    mbs = [
        make(
            mine[i * per : (i + 1) * per], cp_size=layout.cp, cp_rank=cp_rank, pad_multiple=multiple
        )
        for i in range(micro)
    ]
    norm = global_loss_normalisers(
        [m.response_mask for m in mbs], [m.fields["positive"] for m in mbs], len(mine),
        dp_cp_group=groups.dp_cp, cp_size=layout.cp, device=torch.device("cpu"),
    )  # fmt: skip
    hf = HFModelConfig.from_hf(HF_CONFIG.to_dict())
    optim = OptimSettings(**{**OPTIM.__dict__, "distributed_optimizer": distributed_optimizer})
    last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
    for head, sd, factory in (("lm", hf_sds[0], None), ("value", hf_sds[1], critic_factory())):
        engine = ModelEngine(hf, layout, head=head, optim=optim)
        engine.load_hf(sd)
        if head == "lm":
            factory = policy_factory(engine.vocab_slice)
        else:  # the critic's values equal the reference's, at the response tokens
            outs = engine.run(mbs, value_scoring_fn(), forward_only=True)
            if last_stage:
                print(f"{name}: critic values max diff {check_values(outs, mbs):.2e}")
        outs = engine.run(mbs, factory(norm))
        grad_norm = engine.step()["grad_norm"]
        loss = torch.tensor(0.0, dtype=torch.float64)
        if last_stage:
            key = "pg_loss" if head == "lm" else "value_loss"
            loss += sum(float(o[key]) for o in outs)
        torch.distributed.all_reduce(loss, group=groups.dp_cp)
        ref_grad_norm, _, ref_sd = refs[head]
        assert abs(grad_norm / ref_grad_norm - 1) < 1e-5, (name, head, grad_norm, ref_grad_norm)
        if last_stage and head == "value":
            assert abs(loss.item() - refs["value_loss_only"]) < 1e-5, (
                name,
                loss.item(),
                refs["value_loss_only"],
            )
        if last_stage and head == "lm":
            assert abs(loss.item() - refs["pg_loss_only"]) < 1e-5, (
                name,
                loss.item(),
                refs["pg_loss_only"],
            )
        worst = 0.0
        for hf_name, tensor in engine.hf_weights():
            worst = max(worst, (tensor - ref_sd[hf_name]).abs().max().item())
        assert worst < 2e-5, f"{name} {head}: updated weights differ by {worst}"
        print(
            f"rank {torch.distributed.get_rank()}: {name} {head}: updated weights max diff "
            f"{worst:.2e}; grad norm {grad_norm:.6f} (reference {ref_grad_norm:.6f})"
        )


def check_values(outs, mbs) -> float:
    """Critic values at this rank's response tokens against the reference's (carried as a
    sample field, so packing and the CP split lay both out the same way)."""
    worst = 0.0
    for mb, out in zip(mbs, outs, strict=True):
        got, want = out["values"][mb.response_mask], mb.fields["ref_value"][mb.response_mask]
        worst = max([worst, *(got - want).abs().tolist()])
    assert worst < 1e-4, f"critic values differ by {worst}"
    return worst


def main() -> None:
    policy_sd, critic_sd = make_weights()
    samples = make_samples(policy_sd)
    refs = {}

    def policy_forward(model, mb, mask):
        return model(mb.tokens, attention_mask=mask).logits

    def critic_forward(model, mb, mask):
        return model(mb.tokens, mask)

    refs["lm"] = reference_step(hf_policy(policy_sd), policy_forward, policy_factory(), samples)
    refs["value"] = reference_step(HFCritic(critic_sd), critic_forward, critic_factory(), samples)
    for b, sample in enumerate(samples):  # the reference critic's values, label-aligned
        start = len(sample.prompt) - 1
        sample.fields["ref_value"] = refs["value"][1][b, start : start + len(sample.response), 0]
    # The engines report the pure PPO / value term; recompute those on the reference.
    mb = pad(samples)
    norm = global_loss_normalisers(
        [mb.response_mask],
        [mb.fields["positive"]],
        len(samples),
        dp_cp_group=None,
        cp_size=1,
        device=torch.device("cpu"),
    )
    with torch.no_grad():
        logits = policy_forward(hf_policy(policy_sd), mb, attention_mask(samples, mb))
        refs["pg_loss_only"] = float(policy_factory()(norm)(logits, mb)[1]["pg_loss"])
        values = critic_forward(HFCritic(critic_sd), mb, attention_mask(samples, mb))
        refs["value_loss_only"] = float(critic_factory()(norm)(values, mb)[1]["value_loss"])
    layouts = {
        "TP2": (ModelLayout(tp=2), 2, False, False),
        "TP2-SP-packed": (ModelLayout(tp=2, sequence_parallel=True), 2, True, False),
        "PP2": (ModelLayout(pp=2), 4, False, False),
        "CP2-packed": (ModelLayout(cp=2), 2, True, False),
        "CP2": (ModelLayout(cp=2), 2, False, False),
        "DP2-distopt": (ModelLayout(), 2, True, True),
    }
    for name in sys.argv[1].split(","):
        layout, micro, packed, distopt = layouts[name]
        check_layout(name, layout, micro, packed, distopt, refs, samples, (policy_sd, critic_sd))
    destroy()


if __name__ == "__main__":
    main()
