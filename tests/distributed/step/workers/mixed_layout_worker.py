"""Worker: a policy and a critic with *different* layouts in the same 4 processes, each on its
own process groups (``build_model_groups``), never initialising ``parallel_state``.

For each pair, both engines are built before either runs, then interleaved: critic values and
policy log-probs (forward-only scoring) against transformers; one training step of each
against one process of transformers + torch AdamW (summed loss, gradient norm, every updated
weight gathered back to HF names by ``engine.hf_weights()``, all names covered). One critic
runs a warmup schedule (its first step at half the learning rate) against a reference at that
rate.

Usage: python mixed_layout_worker.py "a,b,c"  (pair names in PAIRS).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from train_step_worker import (
    HF_CONFIG,
    OPTIM,
    HFCritic,
    attention_mask,
    critic_factory,
    hf_policy,
    make_samples,
    make_weights,
    policy_factory,
)

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.data.packing import pack, pad
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.cpu_shim import initialize_cpu_process_group
from vapo_megatron.parallel.model_groups import build_model_groups
from vapo_megatron.parallel.reductions import global_loss_normalisers
from vapo_megatron.step.losses import logprob_scoring_fn, value_scoring_fn

WARMUP = OptimSettings(**{**OPTIM.__dict__, "lr_warmup_steps": 2})
# name: ((policy layout, micro-batches, packed), (critic layout, micro-batches, packed), critic
# distributed optimizer, critic optim settings)
PAIRS = {
    "a": (  # policy TP2 (SP, packed) x DP2; critic TP1 x DP4, distributed optimizer
        (ModelLayout(tp=2, sequence_parallel=True), 2, True),
        (ModelLayout(), 1, True),
        True,
        OPTIM,
    ),
    "b": (  # policy TP1 x DP4; critic PP2 x DP2 with a warmup schedule
        (ModelLayout(), 2, False),
        (ModelLayout(pp=2), 4, False),
        False,
        WARMUP,
    ),
    "c": (  # policy TP2 x PP2 (interleaved, vpp 2); critic CP2 x DP2 (packed)
        (ModelLayout(tp=2, pp=2, vpp=2), 2, False),
        (ModelLayout(cp=2), 2, True),
        False,
        OPTIM,
    ),
}


def reference_step(model, forward, loss_factory, samples, lr):
    """One step on one process; returns (grad norm before clipping, outputs, updated weights)."""
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
    loss, metrics = loss_factory(norm)(output, mb)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.clip_grad)
    torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(OPTIM.adam_beta1, OPTIM.adam_beta2),
        eps=OPTIM.adam_eps, weight_decay=0.0,
    ).step()  # fmt: skip
    key = "pg_loss" if "pg_loss" in metrics else "value_loss"
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return grad_norm.item(), float(metrics[key]), output.detach(), weights


def policy_forward(model, mb, mask):
    return model(mb.tokens, attention_mask=mask).logits


def critic_forward(model, mb, mask):
    return model(mb.tokens, mask)


def references(policy_sd, critic_sd, samples):
    refs = {
        "lm": reference_step(hf_policy(policy_sd), policy_forward, policy_factory(), samples, OPTIM.lr),
        "value": reference_step(
            HFCritic(critic_sd), critic_forward, critic_factory(), samples, OPTIM.lr
        ),
        "value_warmup": reference_step(
            HFCritic(critic_sd), critic_forward, critic_factory(), samples,
            OPTIM.lr / WARMUP.lr_warmup_steps,
        ),
    }  # fmt: skip
    mb = pad(samples)
    with torch.no_grad():
        logits = policy_forward(hf_policy(policy_sd), mb, attention_mask(samples, mb))
    logp = torch.log_softmax(logits, -1).gather(-1, mb.labels[..., None]).squeeze(-1)
    values = refs["value"][2]
    for b, sample in enumerate(samples):  # label-aligned reference outputs, carried as fields
        start = len(sample.prompt) - 1
        sample.fields["ref_value"] = values[b, start : start + len(sample.response), 0]
        sample.fields["ref_logprob"] = logp[b, start : start + len(sample.response)]
    return refs


class Side:
    """One model of a pair: its engine, this rank's micro-batches and loss normalisers."""

    def __init__(self, head, layout, micro, packed, optim, sd, samples):
        hf = HFModelConfig.from_hf(HF_CONFIG.to_dict())
        groups = build_model_groups(tp=layout.tp, pp=layout.pp, cp=layout.cp)
        self.head, self.layout = head, layout
        self.engine = ModelEngine(hf, layout, head=head, optim=optim, groups=groups)
        self.engine.load_hf(sd)
        e = self.engine
        mine = samples[
            e.dp_rank * len(samples) // e.dp_size : (e.dp_rank + 1) * len(samples) // e.dp_size
        ]
        per = len(mine) // micro
        multiple = 16 if layout.pp > 1 else (layout.tp if layout.sequence_parallel else 1)
        make = pack if packed else pad
        self.mbs = [
            make(mine[i * per : (i + 1) * per], cp_size=layout.cp, cp_rank=e.cp_rank,
                 pad_multiple=multiple)
            for i in range(micro)
        ]  # fmt: skip
        self.norm = global_loss_normalisers(
            [m.response_mask for m in self.mbs], [m.fields["positive"] for m in self.mbs],
            len(mine), dp_cp_group=groups.parallel.dp_cp, cp_size=layout.cp, device=torch.device("cpu"),
        )  # fmt: skip

    def score(self) -> float:
        """Forward-only values or log-probs at this rank's response tokens vs the reference."""
        if self.head == "value":
            fn, key, ref = value_scoring_fn(), "values", "ref_value"
        else:
            fn, key, ref = logprob_scoring_fn(self.engine.vocab_slice), "logprobs", "ref_logprob"
        outs = self.engine.run(self.mbs, fn, forward_only=True)
        assert len(outs) == (len(self.mbs) if self.engine.is_last_stage else 0)
        worst = 0.0
        for mb, out in zip(self.mbs[: len(outs)], outs, strict=True):
            got, want = out[key][mb.response_mask], mb.fields[ref][mb.response_mask]
            worst = max([worst, *(got - want).abs().tolist()])
        assert worst < 1e-4, f"{self.head} scoring differs by {worst}"
        return worst

    def train(self):
        """Forward + backward (the step comes later, so the two models' steps interleave)."""
        factory = policy_factory(self.engine.vocab_slice) if self.head == "lm" else critic_factory()
        outs = self.engine.run(self.mbs, factory(self.norm))
        loss = torch.tensor(0.0, dtype=torch.float64)
        if self.engine.is_last_stage:
            key = "pg_loss" if self.head == "lm" else "value_loss"
            loss += sum(float(o[key]) for o in outs)
        dist.all_reduce(loss, group=self.engine.groups.parallel.dp_cp)
        self.loss = loss.item()

    def check_step(self, name, ref, lr):
        grad_norm, ref_loss, _, ref_sd = ref
        result = self.engine.step()
        assert abs(result["lr"] - lr) < 1e-15, (name, self.head, result["lr"], lr)
        assert abs(result["grad_norm"] / grad_norm - 1) < 1e-5, (name, self.head, result, grad_norm)
        if self.engine.is_last_stage:
            assert abs(self.loss - ref_loss) < 1e-5, (name, self.head, self.loss, ref_loss)
        worst, names = 0.0, []
        for hf_name, tensor in self.engine.hf_weights():
            worst = max(worst, (tensor - ref_sd[hf_name]).abs().max().item())
            names.append(hf_name)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, names)
        covered = set().union(*everyone)
        assert covered == set(ref_sd), sorted(covered ^ set(ref_sd))[:5]
        assert worst < 2e-5, f"{name} {self.head}: updated weights differ by {worst}"
        print(
            f"rank {dist.get_rank()}: {name} {self.head} {self.layout.tp}x{self.layout.pp}x"
            f"{self.layout.cp}: updated weights max diff {worst:.2e}; grad norm "
            f"{result['grad_norm']:.6f} (reference {grad_norm:.6f}); lr {result['lr']:.1e}"
        )


def check_pair(name, samples, refs, sds):
    (p_layout, p_micro, p_packed), (c_layout, c_micro, c_packed), distopt, c_optim = PAIRS[name]
    c_optim = OptimSettings(**{**c_optim.__dict__, "distributed_optimizer": distopt})
    policy = Side("lm", p_layout, p_micro, p_packed, OPTIM, sds[0], samples)
    critic = Side("value", c_layout, c_micro, c_packed, c_optim, sds[1], samples)
    diffs = critic.score(), policy.score()
    policy.train()
    critic.train()
    policy.check_step(name, refs["lm"], OPTIM.lr)
    warm = c_optim.lr_warmup_steps
    critic.check_step(
        name, refs["value_warmup" if warm else "value"], OPTIM.lr / warm if warm else OPTIM.lr
    )
    if warm:  # the schedule resumes where it was: a fresh one loaded from it agrees
        state = critic.engine.scheduler.state_dict()
        fresh = Side("value", c_layout, c_micro, c_packed, c_optim, sds[1], samples).engine
        fresh.scheduler.load_state_dict(state)
        assert fresh.scheduler.num_steps == 1 and fresh.step()["lr"] == OPTIM.lr
    print(
        f"rank {dist.get_rank()}: {name} scoring max diff values {diffs[0]:.2e} logprobs {diffs[1]:.2e}"
    )


def main() -> None:
    initialize_cpu_process_group()
    policy_sd, critic_sd = make_weights()
    samples = make_samples(policy_sd)
    refs = references(policy_sd, critic_sd, samples)
    for name in sys.argv[1].split(","):
        check_pair(name, samples, refs, (policy_sd, critic_sd))
    # Nothing above may have leaned on megatron's global layout.
    assert not parallel_state.model_parallel_is_initialized()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
