"""Worker: a whole tiny ``vapo-train`` run (one VAPO step, checkpoint, HF export) under three
recorders, each standing in for a CUDA behaviour this CPU machine cannot show.

1. Tensor factories. Every ``torch.arange/zeros/tensor/...`` called from ``vapo_megatron``
   code must name its device: a device-less call lands on the host, which on a GPU either
   fails when mixed with device tensors or sends a host tensor into NCCL.
2. Collectives. ``vapo_megatron`` code calls ``torch.distributed`` collectives only through
   ``parallel/collectives.py`` (which checks each tensor against its group's backend), and
   object collectives only on a gloo group made for the host (on NCCL they stage world x
   payload bytes on the GPU).
3. Micro-batches. Every input the Megatron model receives came out of ``MicroBatch.to``, the
   one place that moves a micro-batch to the model's device.
4. Group timeouts. Every ``new_group`` call (ours, megatron's, vLLM's) and the timeout it
   was given: a group made without one keeps NCCL's 10 minutes on a GPU.

argv: the recipe, then overrides. Prints one ``PLACEMENT {json}`` line per rank.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import vapo_megatron

PACKAGE = str(Path(vapo_megatron.__file__).parent) + "/"
COLLECTIVES = PACKAGE + "parallel/collectives.py"
FACTORIES = {
    torch.arange, torch.empty, torch.eye, torch.full, torch.linspace, torch.ones, torch.rand,
    torch.randint, torch.randn, torch.randperm, torch.scalar_tensor, torch.tensor, torch.zeros,
    torch.as_tensor, torch.empty_strided,
}  # fmt: skip
TENSOR_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "gather",
    "scatter", "broadcast", "send", "recv", "isend", "irecv", "all_to_all_single", "barrier",
    "reduce", "batch_isend_irecv",
)  # fmt: skip
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object")


def our_site(depth: int) -> str | None:
    """``file:line`` of the frame ``depth`` above the caller, when it is project code."""
    frame = sys._getframe(depth + 1)
    name = frame.f_code.co_filename
    if name.startswith(PACKAGE):
        return f"{name[len(PACKAGE) :]}:{frame.f_lineno}"
    return None


def origin_outside_collectives() -> str | None:
    """The first project frame that is not ``parallel/collectives.py`` (who asked for it)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(PACKAGE) and name != COLLECTIVES:
            return f"{name[len(PACKAGE) :]}:{frame.f_lineno}"
        frame = frame.f_back
    return None


class Report:
    def __init__(self) -> None:
        self.deviceless: set[str] = set()
        self.factory_calls = 0
        self.direct: set[str] = set()
        self.object_off_host: set[str] = set()
        self.through_helper = 0
        self.host_groups: list[dist.ProcessGroup] = []
        self.group_timeouts: dict[str, Counter[str]] = defaultdict(Counter)
        self.moved: list[torch.Tensor] = []  # held, so an id is never reused
        self.moved_ids: set[int] = set()
        self.model_calls = 0
        self.unmoved_inputs: set[str] = set()


REPORT = Report()


class FactoryAudit(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES:
            site = our_site(1)
            if site is not None:
                REPORT.factory_calls += 1
                if kwargs.get("device") is None:
                    REPORT.deviceless.add(f"{site} torch.{func.__name__}")
        return func(*args, **kwargs)


def wrap_collectives() -> None:
    new_group = dist.new_group

    def recording_new_group(*args, **kwargs):
        group = new_group(*args, **kwargs)
        if kwargs.get("backend") == "gloo":
            REPORT.host_groups.append(group)
        caller = sys._getframe(1).f_code.co_filename
        maker = "vllm" if "/vllm/" in caller else "megatron" if "/megatron/" in caller else "ours"
        REPORT.group_timeouts[maker][str(kwargs.get("timeout"))] += 1
        return group

    dist.new_group = recording_new_group
    for name in TENSOR_COLLECTIVES + OBJECT_COLLECTIVES:
        original = getattr(dist, name)

        def recording(*args, __original=original, __name=name, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(PACKAGE):
                if caller == COLLECTIVES:
                    REPORT.through_helper += 1
                else:
                    REPORT.direct.add(f"{our_site(1)} dist.{__name}")
                if __name in OBJECT_COLLECTIVES:
                    group = kwargs.get("group")
                    if not any(group is host for host in REPORT.host_groups):
                        REPORT.object_off_host.add(f"{origin_outside_collectives()} {__name}")
            return __original(*args, **kwargs)

        setattr(dist, name, recording)


def wrap_model_inputs() -> None:
    from megatron.core.models.gpt import GPTModel

    from vapo_megatron.data.packing import MicroBatch

    to = getattr(MicroBatch, "to", None)
    if to is not None:

        def recording_to(self, *args, **kwargs):
            moved = to(self, *args, **kwargs)
            REPORT.moved.append(moved.tokens)
            REPORT.moved_ids.add(id(moved.tokens))
            return moved

        MicroBatch.to = recording_to
    forward = GPTModel.forward

    def checked_forward(self, input_ids, *args, **kwargs):
        REPORT.model_calls += 1
        if id(input_ids) not in REPORT.moved_ids:
            REPORT.unmoved_inputs.add(f"{tuple(input_ids.shape)} from {our_site_anywhere()}")
        return forward(self, input_ids, *args, **kwargs)

    GPTModel.forward = checked_forward


def our_site_anywhere() -> str | None:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(PACKAGE):
            return f"{frame.f_code.co_filename[len(PACKAGE) :]}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def main() -> None:
    from vapo_megatron import train

    wrap_collectives()
    wrap_model_inputs()
    with FactoryAudit():
        status = train.main(sys.argv[1:])
    rank = int(os.environ["RANK"])  # the run ended with the process group
    report = {
        "rank": rank,
        "status": status,
        "factory_calls": REPORT.factory_calls,
        "deviceless": sorted(REPORT.deviceless),
        "collectives_through_helper": REPORT.through_helper,
        "direct_collectives": sorted(REPORT.direct),
        "object_collectives_off_host": sorted(REPORT.object_off_host),
        "model_calls": REPORT.model_calls,
        "unmoved_inputs": sorted(REPORT.unmoved_inputs),
        "group_timeouts": REPORT.group_timeouts,
    }
    print("PLACEMENT " + json.dumps(report), flush=True)


if __name__ == "__main__":  # megatron's checkpoint writer spawns processes that import this
    main()
