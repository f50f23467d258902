"""Part: the training state's round trip to the host while vLLM would be awake
(``engine/offload.py::TrainingOffload``), on the 32B-path engines after their steps.

In the trainer's order (``offload_for_weights``, then ``offload_policy_params``, then
``restore``), with the engines' parameters gathered first as the weight sync gathers them.
Held: while offloaded, no storage of either model's parameters or optimizer state holds a
byte on the device; after the return, parameters and optimizer state (main parameters, Adam
moments) are bit for bit what they were (gradients are dropped and come back as zeros: the
next update zeroes them anyway), and one more step trains.

What can be measured where:

- on a GPU the host arena is pinned (``is_pinned``); the allocator's bytes
  (``memory_allocated``) drop by at least the state's bytes; the driver's free memory
  (``torch.cuda.mem_get_info``, what vLLM sizes itself from) grows. At this model's size (a
  few MiB) the driver's number is bounded by the allocator's 2 MiB segments, which the
  state shares with other live tensors; at 32B each buffer is GiBs and gets its own segments.
- on --cpu the "device" is the host: the state's storages are emptied and copied into a
  second host buffer, so nothing is freed; what is reported is the bytes copied, the bytes
  dropped and the state's resident bytes before and during the offload.
"""

from __future__ import annotations

import time

import torch

from gpu_checks.compare import compare_exact, resident_bytes, tensors_of
from gpu_checks.context import Context
from gpu_checks.frame import check
from gpu_checks.recipe32b_parts import shard_step
from vapo_megatron.engine.offload import TrainingOffload

MB = 1e6


def offload(ctx: Context, numbers: dict) -> None:
    ctx.results.need("shard_steps")
    engines = {"policy": ctx.shard_policy, "critic": ctx.shard_critic}
    for engine in engines.values():
        engine.gather_params()  # as before the weight sync, which the offload brackets
    saved = {name: tensors_of(engine) for name, engine in engines.items()}
    state = resident_bytes(list(engines.values()), ctx.device)
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(ctx.device)
        free_before, _ = torch.cuda.mem_get_info(ctx.device)
        allocated_before = torch.cuda.memory_allocated(ctx.device)
    round_trip = TrainingOffload(ctx.shard_policy, ctx.shard_critic)
    start = time.perf_counter()
    try:
        round_trip.offload_for_weights()
        round_trip.offload_policy_params()
        numbers["offload_s"] = time.perf_counter() - start
        left = resident_bytes(list(engines.values()), ctx.device)
        copied = round_trip.offloaded_bytes
        numbers.update(
            state_mb=state / MB, left_on_device_mb=left / MB, copied_mb=copied / MB,
            grads_dropped_mb=round_trip.dropped_bytes / MB,
        )  # fmt: skip
        if cuda:
            free_after, _ = torch.cuda.mem_get_info(ctx.device)
            allocated_drop = allocated_before - torch.cuda.memory_allocated(ctx.device)
            numbers.update(
                pinned=bool(round_trip.arena.buffer.is_pinned()),
                allocated_freed_mb=allocated_drop / MB,
                driver_freed_mb=(free_after - free_before) / MB,
            )  # fmt: skip
        else:
            numbers["pinned"] = numbers["driver_freed_mb"] = "n/a (--cpu: host to host)"
    finally:  # whatever failed, the engines get their state back
        start = time.perf_counter()
        round_trip.restore()
        numbers["restore_s"] = time.perf_counter() - start
    check(state > 0, "no training state found on the device: the check is vacuous")
    check(left == 0, f"{left} bytes of parameters or optimizer state stayed on the device")
    check(round_trip.offloaded_bytes == 0, "restore() left bytes counted on the host")
    check(copied >= state, f"{copied} bytes copied to the host, fewer than the state's {state}")
    if cuda:
        check(numbers["pinned"], "the host arena is not page-locked")
        check(allocated_drop >= state, f"the allocator freed {allocated_drop} < {state} bytes")
        check(free_after > free_before, "the driver sees no memory freed (empty_cache?)")
    compared = 0
    for name, engine in engines.items():
        n, _ = compare_exact(saved[name], tensors_of(engine), f"{name} after the round trip")
        compared += n
    numbers["tensors_equal"] = compared
    after = shard_step(ctx)  # training goes on from the restored state
    numbers.update(
        step_after_s=after["seconds"], value_loss_after=after["value_loss"],
        policy_grad_norm_after=after["policy_grad_norm"],
    )  # fmt: skip
    round_trip.release()  # the engine's shutdown gives the arena back
