"""Worker: a training checkpoint saved at one layout resumes at another, and the following steps
stay close to the uninterrupted run.

``save`` (2 ranks), per case: train policy and critic 2 steps (0 for ``-unstepped``) from HF
weights, save, train 2 more steps; rank 0 writes what the uninterrupted run did in those 2
steps (gradient norms, learning rates, the HF weights after them) to ``<case>/reference.pt``.
``load`` (1 rank): fresh engines at DP1 TP1 from other random weights load the checkpoint,
train 2 steps, and compare.

Cases: ``DP2`` (distributed optimizer, default ``dp_reshardable`` format, loaded at DP1),
``TP2-full`` (distributed optimizer saved ``fully_reshardable``, loaded at TP1), ``TP2-plain``
(plain optimizer, state per parameter, loaded at TP1). Not bit-exact: the gradient of the same
global batch is summed in another order (one rank's micro-batches instead of an all-reduce over
two; whole matrices instead of TP halves), about 1 ulp of fp32 per reduction; Adam divides by
sqrt(v) + eps, so the relative differences of the updates stay of that order.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.distributed.checkpoint.workers.train_checkpoint_worker import Run
from tests.distributed.step.workers.train_step_worker import make_samples, make_weights
from vapo_megatron.checkpoint.directory import FORMAT, MARKER, OLD_FORMAT_COMMIT, step_dir_name
from vapo_megatron.checkpoint.load import load_train_checkpoint
from vapo_megatron.checkpoint.save import save_train_checkpoint
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu

CASES = {  # name: (saved layout, distributed optimizer, fully_reshardable, steps before the save)
    "DP2": (ModelLayout(), True, False, 2),
    "TP2-full": (ModelLayout(tp=2), True, True, 2),
    "TP2-plain": (ModelLayout(tp=2), False, False, 2),
    "DP2-unstepped": (ModelLayout(), True, False, 0),  # a policy frozen until the save
}
GRAD_NORM_RTOL = 1e-5
"""fp32 sums in another order: ~1e-7 relative per reduction, a few reductions deep."""
WEIGHT_ATOL = 1e-6
"""Two Adam steps of lr 1e-3 whose update directions differ by ~1e-5 relative at most."""


def record(run: Run) -> dict[str, list[float]]:
    """Gradient norms and learning rates of one step of both models."""
    out = run.train_step()
    steps = [entry for entry in out if "grad_norm" in entry]
    return {
        "grad_norm": [float(s["grad_norm"]) for s in steps],
        "lr": [float(s["lr"]) for s in steps],
    }


def hf_weights(run: Run) -> dict[str, dict[str, torch.Tensor]]:
    return {
        name: {k: v.detach().clone() for k, v in engine.hf_weights()}
        for name, engine in run.engines.items()
    }


def make_run(case: str, *, layout: ModelLayout, hf_sds, samples) -> Run:
    _, distopt, fully_reshardable, _ = CASES[case]
    run = Run(layout, distopt, torch.float32, hf_sds, samples, with_weights=False)
    run.states = {
        name: dataclasses.replace(state, fully_reshardable=fully_reshardable)
        for name, state in run.states.items()
    }
    return run


def save_phase(root: Path, samples, hf_sds) -> None:
    for case, (layout, _, _, before) in CASES.items():
        run = make_run(case, layout=layout, hf_sds=hf_sds, samples=samples)
        for _ in range(before):
            run.train_step()
        save_train_checkpoint(root / case, before, run.states, {"step": before}, keep_last=1)
        steps = [record(run) for _ in (1, 2)]
        weights = hf_weights(run)
        if dist.get_rank() == 0:
            torch.save({"steps": steps, "weights": weights}, root / case / "reference.pt")
        dist.barrier()


def check_old_format_refused(root: Path, run: Run) -> None:
    """A checkpoint of the per-rank format (format_version 1) is refused with the command that
    continues from it: the HF export of its policy weights where it has them, else the commit
    that still reads it."""
    for with_weights in (True, False):
        directory = root / f"old-{with_weights}" / step_dir_name(5)
        directory.mkdir(parents=True)
        meta = {"format": FORMAT, "format_version": 1, "step": 5, "world_size": 2, "models": {
            name: {"layout": state.layout, "weights": with_weights}
            for name, state in run.states.items()
        }}  # fmt: skip
        (directory / "meta.json").write_text(json.dumps(meta))
        (directory / "policy").mkdir()
        (directory / "policy" / "rank_00000.pt").write_bytes(b"per-rank pickle")
        publish_marker = directory / MARKER
        publish_marker.write_text("{}\n")
        try:
            load_train_checkpoint(directory.parent, run.states)
            raise AssertionError("an old-format checkpoint loaded")
        except ValueError as err:
            assert "old per-rank format" in str(err), err
            if with_weights:
                want = f"tools/convert.py mcore-to-hf --ckpt {directory}/policy/weights"
            else:
                want = f"git checkout {OLD_FORMAT_COMMIT}"
            assert want in str(err), err
    print("old per-rank checkpoints refused with the command that continues from them")


def load_phase(root: Path, samples) -> None:
    torch.manual_seed(1234)  # other random weights than the saved ones
    for case in CASES:
        run = make_run(case, layout=ModelLayout(), hf_sds=None, samples=samples)
        if case == "DP2":
            check_old_format_refused(root, run)
        before = CASES[case][3]
        assert load_train_checkpoint(root / case, run.states) == {"step": before}
        steps = [record(run) for _ in (1, 2)]
        weights = hf_weights(run)
        want = torch.load(root / case / "reference.pt")
        grad_rel = 0.0
        for got_step, want_step in zip(steps, want["steps"], strict=True):
            assert got_step["lr"] == want_step["lr"], (case, got_step, want_step)
            for g, w in zip(got_step["grad_norm"], want_step["grad_norm"], strict=True):
                grad_rel = max(grad_rel, abs(g - w) / abs(w))
        weight_abs = 0.0
        for model, tensors in want["weights"].items():
            assert sorted(weights[model]) == sorted(tensors), model
            for key, tensor in tensors.items():
                weight_abs = max(weight_abs, float((weights[model][key] - tensor).abs().max()))
        assert grad_rel <= GRAD_NORM_RTOL, f"{case}: grad norms differ by {grad_rel:.2e} relative"
        assert weight_abs <= WEIGHT_ATOL, f"{case}: weights differ by {weight_abs:.2e}"
        print(
            f"{case} -> DP1 TP1: next 2 steps' grad norms within {grad_rel:.1e} relative, weights "
            f"within {weight_abs:.1e}"
        )


def main() -> None:
    phase, root = sys.argv[1], Path(sys.argv[2])
    policy_sd, critic_sd = make_weights()
    samples = make_samples(policy_sd)
    initialize_megatron_cpu()
    if phase == "save":
        save_phase(root, samples, {"policy": policy_sd, "critic": critic_sd})
    else:
        load_phase(root, samples)
    destroy()


if __name__ == "__main__":
    main()
