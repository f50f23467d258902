"""Worker: a checkpoint written before an optimizer's first step loads, and the run continues
bit for bit (issue 25, item 1).

Per case (plain optimizer at TP2, distributed optimizer at DP2; torch's AdamW, or a stand-in
for Transformer Engine's ``FusedAdam``, which makes its state lazily at the first ``step()``
and keeps the step count in its parameter groups): the critic takes one step while the policy
stays frozen, as in critic pretraining; save; train both 2 more steps. Fresh engines from other
weights load the checkpoint and must give the same losses, gradient norms, weights, optimizer
state and scheduler, bit for bit. The stand-in is installed where megatron-core picks TE's
Adam (``megatron.core.optimizer.Adam`` with ``USING_PYTORCH_OPTIMIZER`` off, and the
distributed optimizer's TE flags), so megatron takes its TE code paths on CPU.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.distributed.checkpoint.workers.train_checkpoint_worker import (
    CASES,
    Run,
    assert_identical,
    rng_draws,
    snapshot,
)
from tests.distributed.step.workers.train_step_worker import (
    critic_factory,
    make_samples,
    make_weights,
)
from vapo_megatron.checkpoint.load import load_train_checkpoint
from vapo_megatron.checkpoint.save import CheckpointSaver
from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu


class LazyFusedAdam(torch.optim.Optimizer):
    """TE ``FusedAdam``'s behaviour that matters to a checkpoint: no state before the first
    ``step()``, which makes ``exp_avg``/``exp_avg_sq``; the step count in each parameter group;
    ``adam_w_mode`` for decoupled weight decay. The update is Adam's."""

    def __init__(self, params, *, lr, weight_decay, betas, eps, adam_w_mode=True):
        defaults = {"lr": lr, "weight_decay": weight_decay, "betas": betas, "eps": eps}
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            group["step"] = group.get("step", 0) + 1
            (beta1, beta2), t = group["betas"], group["step"]
            for p in params:
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                grad = p.grad
                if group["weight_decay"]:
                    if self.adam_w_mode:
                        p.mul_(1 - group["lr"] * group["weight_decay"])
                    else:
                        grad = grad.add(p, alpha=group["weight_decay"])
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (state["exp_avg_sq"] / (1 - beta2**t)).sqrt_().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1**t))


def install_lazy_adam() -> None:
    import megatron.core.optimizer as mopt
    import megatron.core.optimizer.distrib_optimizer as dopt

    mopt.USING_PYTORCH_OPTIMIZER = False
    mopt.Adam = LazyFusedAdam
    dopt.Adam = LazyFusedAdam  # its type check
    dopt.HAVE_APEX_OR_TE = True
    dopt.USING_TE_OPTIMIZER = True


def critic_step(run: Run) -> list[object]:
    """The critic alone takes a step (the policy stays frozen, as in critic pretraining)."""
    engine = run.engines["critic"]
    outs = engine.run(run.mbs, critic_factory()(run.norm))
    return [{k: v.detach().clone() for k, v in o.items()} for o in outs] + [engine.step()]


def check_case(name: str, adam: str, root: Path, samples, hf_sds) -> None:
    layout, distopt, dtype = CASES[name]
    rank = dist.get_rank()
    first = Run(layout, distopt, dtype, hf_sds, samples, with_weights=False)
    policy_inner = [
        opt.optimizer
        for opt in getattr(first.states["policy"].optimizer, "chained_optimizers", [])
        or [first.states["policy"].optimizer]
    ]
    if adam == "lazy":
        assert all(isinstance(o, LazyFusedAdam) for o in policy_inner), policy_inner
    first_steps = critic_step(first)
    assert all(not o.state for o in policy_inner), "the frozen policy already has state"
    extra = {"state": {"step": 0, "pretrain_step": 1}}
    CheckpointSaver().save(root, 1, first.states, extra, keep_last=0)
    draws = rng_draws()
    want = [first.train_step() for _ in (2, 3)]
    want_state = snapshot(first)

    torch.manual_seed(2000 + rank)  # fresh engines from other random weights, other RNG
    random.seed(11)
    second = Run(layout, distopt, dtype, None, samples, with_weights=False)
    assert load_train_checkpoint(root, second.states) == extra
    assert_identical(rng_draws(), draws, f"{name}-{adam} rng")
    got = [second.train_step() for _ in (2, 3)]
    assert_identical(got, want, f"{name}-{adam} losses and grad norms")
    assert_identical(snapshot(second), want_state, f"{name}-{adam} state")
    assert first_steps, "the critic did not step"
    print(f"rank {rank}: {name}-{adam}: saved before the policy's first step, resumed identical")
    dist.barrier()


def main() -> None:
    adam, cases, root = sys.argv[1], sys.argv[2].split(","), Path(sys.argv[3])
    if adam == "lazy":
        install_lazy_adam()
    policy_sd, critic_sd = make_weights()
    samples = make_samples(policy_sd)
    hf_sds = {"policy": policy_sd, "critic": critic_sd}
    initialize_megatron_cpu()
    for name in cases:
        check_case(name, adam, root / f"{name}-{adam}", samples, hf_sds)
    destroy()


if __name__ == "__main__":
    main()
