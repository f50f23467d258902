"""One model's own process groups (TP/PP/CP/DP over all ranks), built without ``parallel_state``.

The policy and the critic each get a :class:`ModelGroups` from :func:`build_model_groups`, so
they can take different layouts in one job. Ranks are laid out as megatron-core's default
order "tp-cp-ep-dp-pp" (tp fastest)::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

and, for the experts of an MoE model, as ``initialize_model_parallel``'s second rank generator
cuts them (``parallel_state.py``: ``expert_decoder_rank_generator``, tp = etp, cp = 1,
dp = edp, same order): each pipeline stage's tp * cp * dp ranks are split again as::

    rank = etp_rank + etp * (ep_rank + ep * (edp_rank + edp * pp_rank))

``ModelGroups.pg_collection`` holds every group that megatron-core 0.16.1's GPTModel,
DistributedDataParallel, get_megatron_optimizer, finalize_model_grads and the pipeline
schedules read from a ``ProcessGroupCollection``, the expert ones included (read from source):
``ep`` (MoELayer's expert split and the token dispatcher's all-to-all, ``moe_layer.py``,
``token_dispatcher.py``), ``expt_tp`` (experts' TP linears, dispatcher), ``tp_ep`` (the
dispatcher's and the aux loss's token counts, ``moe_utils.py``), ``tp_ep_pp`` (the expert
optimizer's grad-norm and clipping group, ``optimizer/__init__.py``), ``expt_dp`` and
``intra_expt_dp`` (DDP's expert gradient buffers, reduced over expert DP for parameters with
``allreduce=False``, ``distributed_data_parallel.py``; the expert distributed optimizer's shard
group). DDP and the optimizer ask for them even for dense models; with ep = 1 and etp = tp
they coincide with the dense ones.

What stays process-global (one per process, shared by both models), and why that is harmless
(found by recording every ``parallel_state`` getter and every collective without a group
during the mixed-layout test's build, scoring, training step and weight export):

- Megatron's RNG tracker (``tensor_parallel.get_cuda_rng_tracker``): seeded once
  (:func:`seed_rng_tracker`) with the first model's TP rank. It only feeds dropout (0 in every
  Qwen2 config here) and weight initialisation on GPU, which the trainer's engines skip
  (``session.build_engine``: every weight is loaded next).
- ``parallel_state``'s global memory buffer: scratch space for sequence-parallel all-gathers,
  used by one model at a time (:func:`ensure_global_memory_buffer`).
- ``get_megatron_optimizer`` runs one ``all_gather_object`` over the world to align parameter
  groups: every model spans all ranks, and every rank builds the models in the same order.
- ``get_tensor_model_parallel_group_if_none`` (tensor-parallel layers, mappings, MLP,
  embedding, finalize_model_grads) asks ``parallel_state.is_initialized()`` but returns the
  group it is given, and every module is given its model's.
- ``dist_checkpointing`` replica ids (``sharded_state_dict``) read ``parallel_state`` unless
  ``metadata={"dp_cp_group": ...}`` is passed: checkpoint code must pass this model's group.

Not global, though megatron falls back to ``parallel_state`` when not handed groups: the
schedule and its p2p communicator, finalize_model_grads (DP, SP norms, tied embeddings),
RoPE's CP chunks, the stage's layer offset, the optimizer's grad-norm group: the engine
hands each one this model's groups.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from vapo_megatron.config.layout import layout_sizes
from vapo_megatron.parallel.collectives import make_host_group
from vapo_megatron.parallel.groups import ParallelGroups

# Coordinates of a rank, fastest-varying first (megatron's "tp-cp-ep-dp-pp" with ep = 1).
_DIMS = ("tp", "cp", "dp", "pp")
# The same rank's coordinates in the expert layout (megatron's expert rank generator).
EXPERT_DIMS = ("etp", "ep", "edp", "pp")


@dataclass(frozen=True, kw_only=True)
class ModelGroups:
    """One model's process groups and this rank's place in its layout."""

    pg_collection: ProcessGroupCollection
    """Megatron's groups for this model (pass as ``pg_collection=``)."""
    parallel: ParallelGroups
    """The project's small bundle (tp, pp, cp, dp, dp_cp) over the same groups."""
    world: dist.ProcessGroup
    """Every rank, on the default backend (NCCL on GPU): device tensors only."""
    host: dist.ProcessGroup
    """Every rank, on gloo: host-side bookkeeping and objects (``parallel/collectives.py``).
    One per job, shared by both models (``build_model_groups(host=)``)."""
    tp_size: int
    """Tensor-parallel size."""
    pp_size: int
    """Pipeline-parallel size."""
    cp_size: int
    """Context-parallel size."""
    dp_size: int
    """Data-parallel size (world / (tp * pp * cp))."""
    tp_rank: int
    """This rank's index in its tensor-parallel group."""
    pp_rank: int
    """This rank's pipeline stage."""
    cp_rank: int
    """This rank's index in its context-parallel group."""
    dp_rank: int
    """This rank's data-parallel replica."""
    ep_size: int = 1
    """Expert-parallel size (1 for dense models)."""
    etp_size: int = 1
    """Expert tensor-parallel size (tp_size unless the layout sets etp)."""
    edp_size: int = 1
    """Expert data-parallel size (tp * cp * dp / (etp * ep))."""
    ep_rank: int = 0
    """This rank's index in its expert-parallel group: it holds experts
    ep_rank * num_experts / ep_size onwards."""
    etp_rank: int = 0
    """This rank's index in its expert tensor-parallel group."""

    @property
    def is_first_stage(self) -> bool:
        """First pipeline stage (holds the embedding)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Last pipeline stage (holds the output layer; losses and outputs appear here)."""
        return self.pp_rank == self.pp_size - 1

    @classmethod
    def from_parallel_state(cls) -> ModelGroups:
        """The groups megatron-core's ``parallel_state`` initialised (one layout per job)."""
        from megatron.core import parallel_state as ps

        return cls(
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
            parallel=ParallelGroups.from_parallel_state(),
            world=dist.group.WORLD,
            host=make_host_group(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            cp_size=ps.get_context_parallel_world_size(),
            dp_size=ps.get_data_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            cp_rank=ps.get_context_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
            edp_size=ps.get_expert_data_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
        )


def build_model_groups(
    *,
    tp: int,
    pp: int,
    cp: int,
    world_size: int | None = None,
    host: dist.ProcessGroup | None = None,
    timeout: timedelta | None = None,
    ep: int = 1,
    etp: int | None = None,
) -> ModelGroups:
    """New gloo/NCCL groups (the default backend) for one model with this layout.

    ``ep``, ``etp``: expert-parallel and expert tensor-parallel sizes (MoE models; etp None:
    tp), cut from the ranks of each pipeline stage as megatron does (module doc).

    Collective: every rank calls it with the same sizes, in the same order (once per model),
    because ``torch.distributed.new_group`` must be called by all ranks for every group.
    DP takes the remaining ranks: dp = world / (tp * pp * cp). ``host``: the job's gloo group
    (``parallel.collectives.make_host_group``); None makes one for this model. ``timeout``
    bounds each collective of every group made here (the trainer passes
    ``trainer.dist_timeout_minutes``): a group made without one gets its backend's default
    (NCCL: 10 minutes), not the default group's. Also creates megatron's scratch
    buffer, so a later ``parallel_state.initialize_model_parallel`` must come after
    ``destroy_global_memory_buffer()`` (``cpu_shim.initialize_megatron_cpu`` does that).
    """
    world = dist.get_world_size() if world_size is None else world_size
    sizes = layout_sizes(tp=tp, pp=pp, cp=cp, world_size=world, ep=ep, etp=etp)
    if world != dist.get_world_size():
        raise ValueError(
            f"world_size={world_size} but torch.distributed has {dist.get_world_size()} ranks; "
            f"pass world_size=None"
        )
    pgs = _pg_collection(_GroupMaker(sizes, timeout))
    ensure_global_memory_buffer()
    me = _coordinates(dist.get_rank(), sizes)
    expert = _coordinates(dist.get_rank(), sizes, EXPERT_DIMS)
    return ModelGroups(
        pg_collection=pgs,
        parallel=ParallelGroups(tp=pgs.tp, pp=pgs.pp, cp=pgs.cp, dp=pgs.dp, dp_cp=pgs.dp_cp),
        world=pgs.intra_dist_opt,  # every rank of the model: the distributed optimizer's span
        host=make_host_group(timeout) if host is None else host,
        tp_size=tp,
        pp_size=pp,
        cp_size=cp,
        dp_size=sizes["dp"],
        tp_rank=me["tp"],
        pp_rank=me["pp"],
        cp_rank=me["cp"],
        dp_rank=me["dp"],
        ep_size=sizes["ep"],
        etp_size=sizes["etp"],
        edp_size=sizes["edp"],
        ep_rank=expert["ep"],
        etp_rank=expert["etp"],
    )


class _GroupMaker:
    """Makes the groups of one layout: every rank list once (every rank must create every
    group, in one order), each bounded by ``timeout``; hands back this rank's."""

    def __init__(self, sizes: dict[str, int], timeout: timedelta | None) -> None:
        self.sizes = sizes
        self.bounded = {} if timeout is None else {"timeout": timeout}
        self.cache: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def mine(self, rank_lists) -> dist.ProcessGroup | None:
        """Create every listed group (all ranks must); return this rank's, None if in none."""
        found = None
        for ranks in map(tuple, rank_lists):
            if ranks not in self.cache:  # identical rank sets share one group
                self.cache[ranks] = dist.new_group(list(ranks), **self.bounded)
            if dist.get_rank() in ranks:
                found = self.cache[ranks]
        return found

    def group(self, *varying: str) -> dist.ProcessGroup:
        """This rank's group among ranks that differ only in the ``varying`` coordinates."""
        return self.mine(rank_groups(self.sizes, *varying))

    def expert_group(self, *varying: str) -> dist.ProcessGroup:
        """The same in the expert layout (``EXPERT_DIMS``: etp, ep, edp, pp)."""
        return self.mine(rank_groups(self.sizes, *varying, dims=EXPERT_DIMS))


def _pg_collection(make: _GroupMaker) -> ProcessGroupCollection:
    """Megatron's collection of one layout's groups, made in the same order on every rank."""
    pipelines = rank_groups(make.sizes, "pp")
    tp_g, cp_g, dp_g, pp_g = make.group("tp"), make.group("cp"), make.group("dp"), make.group("pp")
    dp_cp, tp_cp, mp = make.group("cp", "dp"), make.group("tp", "cp"), make.group("tp", "pp")
    everyone = make.group("tp", "cp", "dp", "pp")
    return ProcessGroupCollection(
        tp=tp_g,
        pp=pp_g,
        cp=cp_g,
        dp=dp_g,
        dp_cp=dp_cp,
        tp_cp=tp_cp,
        mp=mp,
        tp_dp_cp=make.group("tp", "cp", "dp"),
        # Tied embeddings: first and last stage of each pipeline (megatron's default ranks).
        # None on the stages in between, as parallel_state leaves them.
        embd=make.mine((r[0], r[-1]) if len(r) > 1 else r for r in pipelines),
        pos_embd=make.mine(r[:1] for r in pipelines),
        # One distributed-optimizer instance spanning the model: intra = dp_cp, no inter.
        intra_dp_cp=dp_cp,
        intra_dist_opt=everyone,
        inter_dist_opt=None,
        # Expert groups (megatron's expert rank generator; at ep = 1 and etp = tp they are the
        # dense tp, mp and dp_cp groups, found again in the cache).
        **_expert_groups(make),
    )


def _expert_groups(make: _GroupMaker) -> dict[str, dist.ProcessGroup]:
    """``ep``, ``expt_tp``, ``tp_ep``, ``tp_ep_pp``, ``expt_dp``, ``intra_expt_dp``, in the
    order megatron's ``initialize_model_parallel`` makes them."""
    expt_dp = make.expert_group("edp")
    return {
        "ep": make.expert_group("ep"),
        "expt_tp": make.expert_group("etp"),
        "tp_ep": make.expert_group("etp", "ep"),
        "tp_ep_pp": make.expert_group("etp", "ep", "pp"),
        "expt_dp": expt_dp,
        "intra_expt_dp": expt_dp,  # one distributed-optimizer instance
    }


def _coordinates(rank: int, sizes: dict[str, int], dims: tuple[str, ...] = _DIMS) -> dict[str, int]:
    coords = {}
    for dim in dims:
        rank, coords[dim] = divmod(rank, sizes[dim])
    return coords


def _rank(coords: dict[str, int], sizes: dict[str, int], dims: tuple[str, ...] = _DIMS) -> int:
    rank = 0
    for dim in reversed(dims):
        rank = rank * sizes[dim] + coords[dim]
    return rank


def rank_groups(
    sizes: dict[str, int], *varying: str, dims: tuple[str, ...] = _DIMS
) -> list[tuple[int, ...]]:
    """Every group of ranks that differ only in the ``varying`` coordinates (``"tp"``: the TP
    groups), ordered by lowest rank, each in increasing rank order (its group ranks follow
    that order): the order every rank creates them in. ``dims``: the layout's coordinates,
    fastest first: the dense one, or ``EXPERT_DIMS`` (``sizes`` from ``layout_sizes``)."""
    fixed = [d for d in dims if d not in varying]
    groups = []
    for values in itertools.product(*(range(sizes[d]) for d in fixed)):
        base = dict(zip(fixed, values, strict=True))
        ranks = sorted(
            _rank({**base, **dict(zip(varying, v, strict=True))}, sizes, dims)
            for v in itertools.product(*(range(sizes[d]) for d in varying))
        )
        groups.append(tuple(ranks))
    return sorted(groups)


def ensure_global_memory_buffer() -> None:
    """Megatron's scratch buffer for sequence-parallel gathers, which ``initialize_model_parallel``
    would otherwise create (process-global, used by one model at a time)."""
    from megatron.core import parallel_state as ps

    if ps._GLOBAL_MEMORY_BUFFER is None:
        ps._set_global_memory_buffer()


def seed_rng_tracker(groups: ModelGroups, seed: int = 1234) -> None:
    """Seed megatron's RNG tracker (once per process) without ``parallel_state``.

    The tracker is process-global, so the first model's TP rank picks the model-parallel
    stream, as ``model_parallel_cuda_manual_seed`` would. Its streams only feed dropout (0 in
    the Qwen2 configs) and GPU weight initialisation (skipped where weights are loaded). Unlike
    ``model_parallel_cuda_manual_seed``, the default generator is left as it is.
    """
    from megatron.core.tensor_parallel import random

    tracker = random.get_cuda_rng_tracker()
    if tracker.is_initialized():
        return
    tracker.add(random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + groups.tp_rank)
    tracker.add(random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + groups.tp_rank)
    tracker.add(random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
