"""The separate placement's worlds: trainer ranks and rollout ranks, each its own default
process group, and the bridge groups between them.

vLLM's external_launcher takes the whole default group as its world (its TP groups, and a
minimum over every rank at start-up), so ranks that build no engine would hang it. Here each
side gets a default group of its own: of the job's N ranks (RANK, WORLD_SIZE), ranks [0, T)
train and ranks [T, N) generate. Before either side starts torch.distributed, ``split_world``
rewrites RANK, WORLD_SIZE and MASTER_PORT to its side's (the trainer side keeps MASTER_PORT,
the rollout side takes VAPO_ROLLOUT_PORT, default MASTER_PORT + 1), so every later init
(ours, Megatron's, vLLM's) sees that side alone. LOCAL_RANK is left alone: it still picks the
rank's GPU.

The bridge is three groups made from one TCPStore (VAPO_BRIDGE_PORT, default MASTER_PORT + 2,
served by global rank 0), each built directly (``ProcessGroupGloo``/``ProcessGroupNCCL``: not
registered with torch.distributed, so their methods are called on the object, with group
ranks):
- ``orders``: trainer rank 0 and every rollout rank (gloo): what the rollout ranks do next;
- ``weights``: the same ranks: the policy's HF-named buckets after each update (NCCL on GPU,
  gloo on CPU);
- ``samples``: rollout rank 0 and every trainer rank (gloo): the graded trajectories, the
  evaluation's numbers.
Each group's operations run in one order on all its members: the protocol is in
``step/remote_rollouts.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from vapo_megatron.parallel.devices import HOST

TRAINER, ROLLOUT = "trainer", "rollout"


@dataclass(frozen=True)
class Placement:
    """Where this rank sits in a job of trainer ranks and rollout ranks."""

    role: str
    """``TRAINER`` or ``ROLLOUT``."""
    global_rank: int
    trainer_world: int
    """T: ranks [0, T) train."""
    rollout_world: int
    """R: ranks [T, T + R) generate."""
    master_addr: str
    bridge_port: int

    @property
    def side_rank(self) -> int:
        """This rank in its side's own world."""
        return self.global_rank - (self.trainer_world if self.role == ROLLOUT else 0)


def split_world(rollout_world: int) -> Placement:
    """This rank's side of a job of WORLD_SIZE ranks whose last ``rollout_world`` generate;
    rewrites the environment to the side's world (call before any process group exists)."""
    if dist.is_initialized():
        raise RuntimeError("split_world must run before torch.distributed is initialized")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not 1 <= rollout_world < world:
        raise ValueError(
            f"{rollout_world} rollout ranks of a {world}-rank job: at least one rank must "
            "train and one generate (rollout.ranks)"
        )
    master_port = int(os.environ["MASTER_PORT"])
    rollout_port = int(os.environ.get("VAPO_ROLLOUT_PORT", master_port + 1))
    bridge_port = int(os.environ.get("VAPO_BRIDGE_PORT", master_port + 2))
    trainer_world = world - rollout_world
    role = TRAINER if rank < trainer_world else ROLLOUT
    placement = Placement(
        role, rank, trainer_world, rollout_world, os.environ.get("MASTER_ADDR", "127.0.0.1"),
        bridge_port,
    )  # fmt: skip
    os.environ["VAPO_GLOBAL_RANK"], os.environ["VAPO_GLOBAL_WORLD_SIZE"] = str(rank), str(world)
    os.environ["RANK"] = str(placement.side_rank)
    os.environ["WORLD_SIZE"] = str(trainer_world if role == TRAINER else rollout_world)
    if role == ROLLOUT:
        os.environ["MASTER_PORT"] = str(rollout_port)
    return placement


@dataclass
class Bridge:
    """This rank's bridge groups (None where it is not a member) and its rank in each."""

    orders: dist.ProcessGroup | None
    weights: dist.ProcessGroup | None
    samples: dist.ProcessGroup | None
    weights_device: torch.device
    """Where the weight buckets travel: the current GPU under NCCL, the host under gloo."""


def make_bridge(placement: Placement, timeout: timedelta) -> Bridge:
    """The three bridge groups (collective over the whole job: every rank calls it once, at
    the same point; members block until all have joined)."""
    n = placement.trainer_world + placement.rollout_world
    store = dist.TCPStore(
        placement.master_addr, placement.bridge_port, n, placement.global_rank == 0,
        timeout=timeout,
    )  # fmt: skip
    rollout = list(range(placement.trainer_world, n))
    to_rollout = [0, *rollout]
    to_trainers = [placement.trainer_world, *range(placement.trainer_world)]
    cuda = torch.cuda.is_available()
    return Bridge(
        orders=_group(store, "orders", to_rollout, placement.global_rank, timeout, nccl=False),
        weights=_group(store, "weights", to_rollout, placement.global_rank, timeout, nccl=cuda),
        samples=_group(store, "samples", to_trainers, placement.global_rank, timeout, nccl=False),
        weights_device=torch.device("cuda", torch.cuda.current_device()) if cuda else HOST,
    )


def _group(
    store: dist.Store,
    name: str,
    members: list[int],
    rank: int,
    timeout: timedelta,
    *,
    nccl: bool,
) -> dist.ProcessGroup | None:
    if rank not in members:
        return None
    prefixed = dist.PrefixStore(f"vapo_bridge/{name}", store)
    if nccl:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, members.index(rank), len(members), options)
    return dist.ProcessGroupGloo(prefixed, members.index(rank), len(members), timeout)


def bridge_broadcast(tensor: torch.Tensor, group: dist.ProcessGroup, device: torch.device) -> None:
    """``tensor`` of the group's rank 0 into ``tensor`` on every member (group ranks: the
    bridge groups are not registered with torch.distributed); ``device`` is where the group
    takes tensors (checked, so a host tensor never reaches NCCL)."""
    if tensor.device.type != device.type:
        raise ValueError(
            f"a bridge broadcast got a tensor on {tensor.device}; this group takes {device}"
        )
    group.broadcast(tensor, 0).wait()
