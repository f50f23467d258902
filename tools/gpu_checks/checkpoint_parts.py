"""Parts: checkpoints as the trainer writes and reads them, into fresh engines, bit for bit.

Every call gets the host group, as the trainer passes it: their barriers and rank-0
broadcasts are object collectives, which run only on gloo (on a GPU the default group is
NCCL; on --cpu the twin reads it so, ``twin.py``)."""

from __future__ import annotations

import time

import torch

from gpu_checks.compare import compare_exact, tensors_of
from gpu_checks.context import Context
from gpu_checks.frame import check
from gpu_checks.tiny import HF_CONFIG
from vapo_megatron.checkpoint.load import load_train_checkpoint
from vapo_megatron.checkpoint.model import load_model_weights, make_metadata, save_model_weights
from vapo_megatron.checkpoint.save import save_train_checkpoint


def checkpoint(ctx: Context, numbers: dict) -> None:
    """``save_train_checkpoint`` / ``load_train_checkpoint`` as the loop resumes."""
    ctx.results.need("engines")
    engines = {"policy": ctx.policy, "critic": ctx.critic}
    saved = {name: tensors_of(e) for name, e in engines.items()}
    schedulers = {name: e.scheduler.state_dict() for name, e in engines.items()}
    root = ctx.workdir / "checkpoints"
    start = time.perf_counter()
    states = {name: e.trainable_state() for name, e in engines.items()}
    save_train_checkpoint(root, 1, states, {"step": 1}, keep_last=1, group=ctx.host)
    numbers["save_s"] = time.perf_counter() - start
    fresh = {
        "policy": ctx.engine("lm", ctx.policy_groups),
        "critic": ctx.engine("value", ctx.critic_groups),
    }
    initial = tensors_of(fresh["policy"])
    differed = sum(
        not torch.equal(v, initial[k].to(v.device))
        for k, v in saved["policy"].items()
        if k.startswith("chunk")
    )
    start = time.perf_counter()
    extra = load_train_checkpoint(
        root, {name: e.trainable_state() for name, e in fresh.items()}, group=ctx.host
    )
    numbers["load_s"] = time.perf_counter() - start
    numbers["mb_on_disk"] = sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) / 1e6
    check(extra == {"step": 1}, f"extra came back as {extra}")
    check(differed > 0, "fresh engines already equal the saved ones: the check is vacuous")
    compared = 0
    for name, engine in fresh.items():
        n, _ = compare_exact(saved[name], tensors_of(engine), name)
        compared += n
        check(engine.scheduler.state_dict() == schedulers[name], f"{name} scheduler differs")
        check(
            {str(p.device) for c in engine.chunks for p in c.parameters()} == {str(ctx.device)},
            f"{name}: loaded parameters not on {ctx.device}",
        )
    numbers["tensors_equal"] = compared


def checkpoint_weights(ctx: Context, numbers: dict) -> None:
    """``save_model_weights`` / ``load_model_weights``: the reshardable dist_checkpointing
    format ``policy.load`` and ``tools/convert.py`` read."""
    ctx.results.need("engines")
    compared = 0
    for name, head, engine, groups in (
        ("policy", "lm", ctx.policy, ctx.policy_groups),
        ("critic", "value", ctx.critic, ctx.critic_groups),
    ):
        directory = ctx.workdir / f"weights_{name}"
        meta = make_metadata(HF_CONFIG, head=head, tp=1, pp=1, dtype=ctx.dtype)
        dp_cp = groups.pg_collection.dp_cp
        save_model_weights(engine.chunks, directory, meta, dp_cp_group=dp_cp)
        fresh = ctx.engine(head, groups)
        load_model_weights(
            fresh.chunks, directory, hf=ctx.hf, head=head, dp_cp_group=dp_cp, host_group=ctx.host
        )
        fresh.optimizer.reload_model_params()  # as Session does after loading
        want = {k: v for k, v in tensors_of(engine).items() if k.startswith("chunk")}
        have = {k: v for k, v in tensors_of(fresh).items() if k.startswith("chunk")}
        want = {k: v for k, v in want.items() if not k.endswith("_extra_state")}
        have = {k: v for k, v in have.items() if not k.endswith("_extra_state")}
        n, _ = compare_exact(want, have, name)
        compared += n
    numbers["tensors_equal"] = compared
