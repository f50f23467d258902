"""Worker: a training checkpoint resumes exactly, at TP2 (plain optimizer) and DP2 (distributed
optimizer), fp32 and bf16, policy and critic, each on its own process groups.

Per case: train 2 steps from HF weights, save (``-async`` cases: in the background, published
only after steps 3-4 ran, so the files must hold step 2's state, not what training changed
meanwhile), draw from every RNG, train 2 more steps and record losses, gradient norms, weights, optimizer state (Adam moments, steps, main params)
and scheduler state. Then leave a half-written save behind (a ``.tmp-*`` directory, a step
directory without its marker, ``latest`` pointing at it), build fresh engines from random
weights, load, and check that the same draws and the same 2 steps give bit-identical results.
Then: loading at another layout is refused and the next save prunes. For TP2 fp32 the policy's
HF weights at step 4 are left in ``policy_hf_step4.pt`` for the test to compare with what
``tools/convert.py mcore-to-hf`` exports from the checkpoint's reshardable weights.
"""

from __future__ import annotations

import os
import random
import signal
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from tests.distributed.step.workers.train_step_worker import (
    HF_CONFIG,
    OPTIM,
    critic_factory,
    make_samples,
    make_weights,
    policy_factory,
)
from vapo_megatron.checkpoint.directory import LATEST, MARKER, complete_steps
from vapo_megatron.checkpoint.load import load_train_checkpoint
from vapo_megatron.checkpoint.model import make_metadata
from vapo_megatron.checkpoint.save import CheckpointSaver, save_train_checkpoint
from vapo_megatron.checkpoint.state import TrainableState
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.data.packing import pad
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu
from vapo_megatron.parallel.model_groups import build_model_groups
from vapo_megatron.parallel.reductions import global_loss_normalisers
from vapo_megatron.trainer.preemption import PreemptionFlag

CASES = {
    "TP2": (ModelLayout(tp=2), False, torch.float32),
    "TP2-bf16": (ModelLayout(tp=2), False, torch.bfloat16),
    "DP2-distopt": (ModelLayout(), True, torch.float32),
    "DP2-distopt-bf16": (ModelLayout(), True, torch.bfloat16),
}
CASES |= {f"{name}-async": case for name, case in CASES.items()}
HEADS = {"policy": "lm", "critic": "value"}
# Warmup then cosine decay: the learning rate changes every step, so a resume that lost the
# scheduler's position would train differently.
SCHEDULE = {"lr_warmup_steps": 1, "lr_decay_style": "cosine", "lr_decay_steps": 10, "min_lr": 1e-4}


class Run:
    """Policy and critic engines, each on its own process groups, trained on one fixed batch."""

    def __init__(self, layout, distopt, dtype, hf_sds, samples, *, with_weights):
        self.hf = HFModelConfig.from_hf(HF_CONFIG.to_dict())
        optim = OptimSettings(**{**OPTIM.__dict__, **SCHEDULE, "distributed_optimizer": distopt})
        groups = build_model_groups(tp=layout.tp, pp=layout.pp, cp=layout.cp)
        self.engines, self.states = {}, {}
        for name, head in HEADS.items():
            engine = ModelEngine(
                self.hf, layout, head=head, optim=optim, groups=groups, params_dtype=dtype
            )
            if hf_sds is not None:
                engine.load_hf(hf_sds[name])
            meta = None
            if with_weights:
                meta = make_metadata(
                    HF_CONFIG.to_dict(), head=head, tp=layout.tp, pp=layout.pp, dtype=dtype
                )
            self.engines[name] = engine
            self.states[name] = engine.trainable_state(weights_meta=meta)
        per = len(samples) // groups.dp_size
        mine = samples[groups.dp_rank * per : (groups.dp_rank + 1) * per]
        half = len(mine) // 2
        self.mbs = [pad(mine[:half]), pad(mine[half:])]
        self.norm = global_loss_normalisers(
            [m.response_mask for m in self.mbs], [m.fields["positive"] for m in self.mbs],
            len(mine), dp_cp_group=groups.parallel.dp_cp, cp_size=1, device=torch.device("cpu"),
        )  # fmt: skip

    def train_step(self) -> list[object]:
        """One step of both models; their per-micro-batch metrics, gradient norms and lrs."""
        record = []
        for name, engine in self.engines.items():
            if name == "policy":
                fn = policy_factory(engine.vocab_slice)(self.norm)
            else:
                fn = critic_factory()(self.norm)
            outs = engine.run(self.mbs, fn)
            record += [{k: v.detach().clone() for k, v in o.items()} for o in outs]
            record.append(engine.step())
        return record


def snapshot(run: Run) -> dict[str, object]:
    """Everything a resume must restore, per model: weights, optimizer, scheduler."""
    out = {}
    for name, state in run.states.items():
        opts = getattr(state.optimizer, "chained_optimizers", [state.optimizer])
        inner = [opt.optimizer for opt in opts]
        out[name] = {
            "weights": [
                {k: v.detach().clone() for k, v in chunk.state_dict().items() if v is not None}
                for chunk in state.chunks
            ],
            "main_params": [
                p.detach().clone() for o in inner for g in o.param_groups for p in g["params"]
            ],
            "adam": [
                {k: v.clone() for k, v in o.state[p].items()}
                for o in inner
                for g in o.param_groups
                for p in g["params"]
            ],
            "groups": [
                {k: v for k, v in g.items() if k != "params"} for o in inner for g in o.param_groups
            ],
            "scheduler": state.scheduler.state_dict(),
        }
    return out


def rng_draws() -> list[object]:
    with tensor_parallel.random.get_cuda_rng_tracker().fork():
        tracked = torch.rand(4)
    return [random.random(), float(np.random.rand()), torch.rand(4), tracked]


def assert_identical(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), f"{where}: max diff {(a.double() - b.double()).abs().max()}"
    elif isinstance(a, dict):
        assert sorted(a) == sorted(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{where}: {len(a)} != {len(b)} entries"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a} != {b}"


def check_preemption_agreement() -> None:
    flag = PreemptionFlag()
    try:
        assert not flag.should_save()
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.should_save()  # rank 0 was not signalled, and agrees
    finally:
        flag.uninstall()
    print(f"rank {dist.get_rank()}: preemption flag agreed")


def check_case(name, root: Path, samples, hf_sds) -> None:
    layout, distopt, dtype = CASES[name]
    rank = dist.get_rank()
    with_weights = layout.tp > 1
    first = Run(layout, distopt, dtype, hf_sds, samples, with_weights=with_weights)
    for _ in (1, 2):
        first.train_step()
    extra = {"step": 2, "sampler": {"epoch": 0, "offset": 16}, "history": [0.5, 0.25]}
    saver = CheckpointSaver(asynchronous=name.endswith("-async"))
    saver.save(root, 2, first.states, extra, keep_last=2)
    draws = rng_draws()
    want = [first.train_step() for _ in (3, 4)]
    if saver.asynchronous:  # written while steps 3-4 changed every tensor; published only now
        assert complete_steps(root) == [] and saver.pending == 2
        assert saver.finish() == 2 and saver.pending is None
        print(f"rank {rank}: {name}: published after steps 3-4")
    assert complete_steps(root) == [2]
    want_state = snapshot(first)
    if dtype == torch.bfloat16:  # the fp32 main params are what the bf16 weights cannot hold
        assert all(p.dtype == torch.float32 for p in want_state["policy"]["main_params"])

    if rank == 0:  # a killed save, a directory without marker, latest pointing at it
        (root / "step_00000003.tmp-dead").mkdir()
        (root / "step_00000003.tmp-dead" / MARKER).write_text("")
        (root / "step_00000003").mkdir()
        (root / "step_00000003" / "meta.json").write_text("{not json")
        (root / LATEST).write_text("3\n")
    dist.barrier()

    torch.manual_seed(1000 + rank)  # fresh engines from other random weights, other RNG
    random.seed(7)
    second = Run(layout, distopt, dtype, None, samples, with_weights=with_weights)
    before = snapshot(second)["policy"]["weights"][0]
    assert any(
        not torch.equal(v, want_state["policy"]["weights"][0][k]) for k, v in before.items()
    ), "the fresh engine already has the trained weights: the test could not fail"
    loaded = load_train_checkpoint(root, second.states)
    assert loaded == extra, loaded
    for state in second.states.values():  # every parameter has its own Adam step counter
        for opt in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
            steps = [s["step"] for s in opt.optimizer.state.values()]
            assert len({id(s) for s in steps}) == len(steps)
    assert_identical(rng_draws(), draws, f"{name} rng")
    got = [second.train_step() for _ in (3, 4)]
    assert_identical(got, want, f"{name} losses and grad norms")
    assert_identical(snapshot(second), want_state, f"{name} state")
    print(f"rank {rank}: {name}: resumed bit-identical (losses, weights, optimizer, scheduler)")

    # The distributed optimizer's default format takes another DP/CP only; neither format
    # loads into the other optimizer.
    change = {"tp": 4} if distopt else {"distributed_optimizer": True}
    other = {k: TrainableState(**{**v.__dict__, "layout": {**v.layout, **change}}) for k, v in
             second.states.items()}  # fmt: skip
    try:
        load_train_checkpoint(root, other)
        raise AssertionError(f"a checkpoint loaded with {change}")
    except ValueError as err:
        key, value = next(iter(change.items()))
        assert "which that format cannot load" in str(err), err
        assert f"{key!r}: {value!r}" in str(err), err

    save_train_checkpoint(root, 4, second.states, {**extra, "step": 4}, keep_last=1)
    entries = sorted(p.name for p in root.iterdir())
    assert entries == [LATEST, "step_00000004"], entries
    assert (root / LATEST).read_text() == "4\n" and complete_steps(root) == [4]
    if with_weights and dtype == torch.float32:  # the test exports these with convert.py
        hf_weights = {k: v.clone() for k, v in second.engines["policy"].hf_weights()}
        if rank == 0:
            torch.save(hf_weights, root / "policy_hf_step4.pt")
    dist.barrier()


def main() -> None:
    cases, root = sys.argv[1].split(","), Path(sys.argv[2])
    policy_sd, critic_sd = make_weights()
    samples = make_samples(policy_sd)
    hf_sds = {"policy": policy_sd, "critic": critic_sd}
    initialize_megatron_cpu()  # parallel_state at DP2: the TP2 models run on their own groups
    check_preemption_agreement()
    for name in cases:
        check_case(name, root / name, samples, hf_sds)
    destroy()


if __name__ == "__main__":
    main()
