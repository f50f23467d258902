"""--cpu's stand-in for NCCL: the project's collectives read every group but the host group
as NCCL, while torch and megatron keep running on gloo.

On a GPU the default group and every model group (``build_model_groups`` makes them without a
backend) are NCCL; only the host group (``collectives.make_host_group``) is gloo. On CPU they
are all gloo, so a call that reaches an object collective on the default group passes on CPU
and raises on the GPU (``collectives.all_gather_objects`` / ``broadcast_object`` refuse any
group that is not gloo). The checkpoint parts did exactly that until they were given the host
group. With the twin installed, ``collectives.group_backend`` answers:

- ``"gloo"`` for the host group(s) handed to :func:`install`;
- ``"nccl"`` for everything else (``None``/WORLD, the models' TP/PP/CP/DP groups), so object
  collectives there fail on CPU as they would on a GPU.

``collectives.group_device`` (what a tensor collective's device check wants) answers the
training device for a group read as NCCL, as on a GPU, and that device is the host on --cpu
(``devices.training_device``). So tensor collectives of the model groups keep working on host
tensors, and checkpoint loading keeps megatron's plain load strategy (its fully parallel
wrapper, chosen where a group's device is CUDA, stages on CUDA). The one mistake the twin
cannot show is a host tensor sent where the training device is wanted: on one CPU they are
the same device. ``tests/unit/parallel/test_collectives.py`` (groups reported NCCL with a CUDA current
device) and ``tests/distributed/test_placement.py`` (a recorded training step) hold that.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from gpu_checks.frame import check
from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.devices import HOST, training_device


def install(host_groups: list[dist.ProcessGroup]) -> Callable[[], None]:
    """From now on, ``collectives`` reads the backends as on a GPU; returns the undo (the
    check keeps the twin for the whole process, a test undoes it)."""
    real_backend, real_device = collectives.group_backend, collectives.group_device

    def group_backend(group: dist.ProcessGroup | None) -> str:
        real = real_backend(group)
        if real != "gloo":
            raise ValueError(f"the NCCL twin runs on gloo groups only, this one is {real}")
        return "gloo" if any(group is host for host in host_groups) else "nccl"

    def group_device(group: dist.ProcessGroup | None) -> torch.device:
        return training_device() if group_backend(group) == "nccl" else HOST

    def undo() -> None:
        collectives.group_backend, collectives.group_device = real_backend, real_device

    collectives.group_backend, collectives.group_device = group_backend, group_device
    return undo


def backends_as_read(host: dist.ProcessGroup) -> dict[str, str]:
    """The backends ``collectives`` reads for the default and the host group, after checking
    that they hold (on a GPU by NCCL itself, on --cpu by the twin): an object collective on
    the default group is refused, on the host group it runs."""
    try:
        collectives.broadcast_object("probe", None)
        refused = False
    except ValueError:
        refused = True
    check(refused, "an object collective on the default group was let through")
    check(collectives.broadcast_object("probe", host) == "probe", "host group broadcast")
    return {"default": collectives.group_backend(None), "host": collectives.group_backend(host)}
