"""Rehearse a recipe at its real world size in one process (``vapo-train RECIPE --dry-run``).

For each chosen rank of an N-rank job the process stands in for that rank: torch.distributed
starts with the ``fake`` backend at (rank, N) (group construction is real, collectives do
nothing), and the trainer's own code (``session.build_groups``, ``session.build_engine``)
builds each model's process groups, GPTModel chunks, DDP wrapper and optimizer on the
``meta`` device: every shape, dtype, bucket and shard is the real run's, no memory is
allocated. The figures are then read from the built objects:

- **groups**: the TP/PP/CP/DP/DPxCP ranks of the policy and the critic, the vLLM replica
  (``rank // rollout.tensor_parallel_size``) and the prompts it generates
  (``step/rollout.replica_share``);
- **bytes**: parameters (each chunk's parameters), the DDP buffers (``grad_data``, and the
  distributed optimizer's ``param_data``, padding included), the optimizer (main-parameter
  copies that are not views of the model's, and Adam's moments, created by megatron's own
  ``init_state_fn`` as a checkpoint save does for a fresh optimizer);
- **checkpoint**: the tensors this rank writes, from the save plan of the trainer's
  checkpoint (``checkpoint.state.sharded_state``: the model's and the optimizer's
  sharded state dicts, split by megatron's fully parallel strategy over the model's
  DP x CP group, ``exchange_utils.determine_main_replica_uniform_distribution``). Under the
  fake backend that strategy's metadata exchange (``all_gather_object``) returns nothing,
  so each peer of the group is built as well and its shard list handed in as the exchange
  would have: the plan is megatron's own, computed on the peers' real shard lists;
- **data**: the data path a VAPO step takes at this rank (``outputs.choose_path`` on the
  built engines: "shards" on one layout, "routed" where the critic's advantages go to the
  policy's owners) and the model's share of a synthetic step of the recipe's shape
  (prompts_per_step x samples_per_prompt samples, seeded lengths up to
  data.max_prompt_tokens + rollout.max_new_tokens): the samples its DP rank owns for the
  step (``scoring_pass.step_share`` over that model's DP size), and its micro-batches
  (``batching.plan_micro_batches``).

Beside each byte figure stands the planner's (``planning/memory.py``, what
``tools/plan.py`` prints for the recipe) and the difference (printed by
``planning/dry_run_report.py``). What is not built is named in
the report with the reason (``FALLBACKS``). Layouts that cannot work fail with the message the
real run gives, from the same checks (``TrainConfig.check``, ``build_model_groups``,
``ModelLayout.check``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from vapo_megatron.config.gpu import FUSION_KERNELS, GpuSettings
from vapo_megatron.config.train import TrainConfig
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.devices import HOST, building_on
from vapo_megatron.planning import memory as mp
from vapo_megatron.planning.host import checkpoint_bytes
from vapo_megatron.planning.params import shard_param_count
from vapo_megatron.planning.workload import planner_workload
from vapo_megatron.step.rollout import replica_share

META = torch.device("meta")

FALLBACKS = (
    "activations: not built (they exist only while a step runs); tools/plan.py estimates them",
    "vLLM memory: no engine is started (its KV cache is sized by vLLM at start on the GPU); "
    "tools/plan.py estimates it",
    "kernel fusions (gpu.*_fusion): off here, as on a machine without CUDA; they change no "
    "parameter, buffer or optimizer byte",
    "checkpoint: tensor bytes of megatron's save plan; ShardedObjects (a few small pickles, "
    "e.g. the optimizer's bucket sizes) are not counted",
)
"""What the dry run does not build, and why (printed with every report)."""


@dataclass(frozen=True, kw_only=True)
class ModelFigures:
    """One model on one rank: its place in the layout and the bytes read from its objects."""

    role: str
    """policy or critic."""
    layout: dict[str, int]
    """tp, pp, cp, dp sizes (and vpp when set)."""
    coords: dict[str, int]
    """This rank's tp, pp, cp, dp rank."""
    groups: dict[str, list[int]]
    """Global ranks of this rank's tp, pp, cp, dp and dp_cp groups."""
    param_count: int
    """Parameters of this rank's chunks."""
    built: dict[str, int]
    """Bytes read from the built objects: params, param_buffer, grads, optimizer, checkpoint."""
    planned: dict[str, int]
    """The planner's bytes for this rank's pipeline stage: params, grads, optimizer."""
    planned_param_count: int
    """``params.shard_param_count`` of this rank's stage."""
    checkpoint: dict[str, int]
    """What this rank writes of a training checkpoint: weights_bytes, weights_tensors,
    optimizer_bytes, optimizer_tensors; group_tensors: shards held in its DP x CP group
    (replicas counted on each holder), among which megatron picked these."""
    data: dict[str, int]
    """This DP rank's share of the synthetic step: samples, tokens, micro-batches."""


@dataclass(frozen=True, kw_only=True)
class RankReport:
    """Everything the dry run found for one rank."""

    rank: int
    world_size: int
    """Ranks the models are built over: the job's, or its trainer ranks' under the separate
    placement."""
    replica: int | None
    """vLLM engine replica of this rank; None: a trainer rank of the separate placement."""
    replica_ranks: list[int]
    """The ranks of that replica (one vLLM TP group); separate placement: every rollout rank
    of the job (the ones after the trainer ranks)."""
    replica_prompts: int
    """Prompts of the step that replica generates (separate placement: all the rollout
    ranks')."""
    data_path: str = ""
    """Whether per-token outputs cross ranks (``outputs.choose_path``): "shards" or "routed",
    with the reason."""
    models: list[ModelFigures] = field(default_factory=list)


@contextmanager
def stand_in_for(rank: int, world_size: int) -> Iterator[None]:
    """Within: this process is rank ``rank`` of ``world_size`` under torch.distributed's fake
    backend (groups are real objects, collectives do nothing), with megatron's CPU shim and
    CUDA hidden."""
    # Importing it registers the "fake" backend (torch's own test helper, no public name yet).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from vapo_megatron.parallel.cpu_shim import apply_cpu_shim

    if dist.is_initialized():
        raise ValueError(
            "the dry run stands in for ranks in a process of its own: start it plainly "
            "(vapo-train RECIPE --dry-run), not under torchrun/srun"
        )
    # As on a laptop whatever this machine has: the CPU shim, megatron's local layer spec
    # (same parameters as Transformer Engine's, which may not build on meta), no kernels.
    cuda_available = torch.cuda.is_available
    torch.cuda.is_available = lambda: False
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    apply_cpu_shim()
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch.cuda.is_available = cuda_available


@contextmanager
def on_meta() -> Iterator[None]:
    """Within: megatron and the project build tensors on ``meta``. Megatron places its DDP
    buffers with an explicit ``device=torch.cuda.current_device()``, so that answers meta too."""
    current = torch.cuda.current_device
    torch.cuda.current_device = lambda: META
    try:
        with torch.device(META), building_on(META):
            yield
    finally:
        torch.cuda.current_device = current


def dry_run_gpu_settings(gpu: GpuSettings) -> GpuSettings:
    """The recipe's GPU settings with kernel fusions off (none exists without CUDA, and none
    changes a byte counted here) and ``auto`` overlaps as a GPU run resolves them: they decide
    the DDP buckets (and so the padding) the real run gets."""
    off = dict.fromkeys(FUSION_KERNELS, False)
    grad = True if gpu.overlap_grad_reduce == "auto" else gpu.overlap_grad_reduce
    return replace(gpu, **off, overlap_grad_reduce=grad)


@dataclass
class _Built:
    """The stand-in's objects for one rank (alive only inside its fake world)."""

    groups: dict[str, Any]
    engines: dict[str, Any]


def _build(config: TrainConfig, models: dict[str, HFModelConfig], roles: Sequence[str]) -> _Built:
    """The trainer's own construction, as ``Session`` does it, of ``roles``' engines, each of
    its own model (``models``: role -> config; the critic's is critic.model's)."""
    from vapo_megatron.trainer.session import build_engine, build_groups

    world_size = dist.get_world_size()
    if config.rollout.placement == "colocated":  # separate: dry_run checked the whole job
        config.check(world_size)  # the real run's first refusal, with its message
        tp = config.rollout.tensor_parallel_size
        for problem in mp.rollout_tp_problems(models["policy"], tp, world_size):
            raise ValueError(f"rollout.tensor_parallel_size: {problem}")
    # The real run's host group is gloo; here every group is fake, and nothing is exchanged.
    policy_groups, critic_groups = build_groups(config, dist.group.WORLD)
    groups = {"policy": policy_groups, "critic": critic_groups}
    gpu = dry_run_gpu_settings(config.gpu)
    engines = {}
    with on_meta():
        for role in roles:
            engines[role] = build_engine(config, models[role], role, groups[role], gpu=gpu)
    return _Built(groups=groups, engines=engines)


def _roles(config: TrainConfig) -> list[str]:
    return ["policy", "critic"] if config.algorithm.uses_critic else ["policy"]


def make_adam_state(engine) -> None:
    """Adam's moments, as after the first step, from megatron's own ``init_state_fn`` (what a
    checkpoint load lays out before it reads), with the distributed optimizer's per-parameter
    step that the trainer's save gives a fresh optimizer."""
    from vapo_megatron.checkpoint.optimizer_state import (
        fill_fresh_optimizer_state,
        sub_optimizers,
    )

    for opt in sub_optimizers(engine.optimizer):
        fill_fresh_optimizer_state(opt)


def _checkpoint_shards(engine) -> tuple[dict, dict]:
    """The model's and the optimizer's sharded state dicts as the trainer's save builds them
    (the optimizer's from the model's before its factories apply), factories applied."""
    from megatron.core.dist_checkpointing.mapping import apply_factories

    from vapo_megatron.checkpoint.state import sharded_state

    model_sd, optimizer_sd = sharded_state(engine.trainable_state(), is_loading=False)
    apply_factories(model_sd)
    apply_factories(optimizer_sd)
    return model_sd, optimizer_sd


def _shards(sharded: dict) -> list:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return [v.without_data() for v in nested_values(sharded) if isinstance(v, ShardedTensor)]


def _written(sharded: dict, group: dist.ProcessGroup, peer_shards: list[list]) -> list:
    """The tensors this rank writes of ``sharded`` under the trainer's fully parallel save
    over ``group``: megatron's distribution, its metadata exchange answered with
    ``peer_shards`` (each group rank's shard list, in group-rank order)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.exchange_utils import (
        determine_main_replica_uniform_distribution,
    )
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        distribute_main_replicas_with_precomputed_distribution,
    )

    def exchange(out: list, _mine: Any, group: Any = None) -> None:
        out[:] = peer_shards

    gather = dist.all_gather_object
    dist.all_gather_object = exchange
    try:
        plan = determine_main_replica_uniform_distribution(sharded, group)
    finally:
        dist.all_gather_object = gather
    distribute_main_replicas_with_precomputed_distribution(sharded, group, plan)
    return [
        v
        for v in nested_values(sharded)
        if isinstance(v, ShardedTensor) and is_main_replica(v.replica_id)
    ]


def _nbytes(shards: Sequence) -> int:
    return sum(math.prod(v.local_shape) * v.dtype.itemsize for v in shards)


def _dp_cp_peers(config: TrainConfig, role: str, rank: int, world_size: int) -> list[int]:
    """The ranks of ``rank``'s DP x CP group of ``role`` (``model_groups.rank_groups``, the
    order ``build_model_groups`` makes them in), without building anything."""
    from vapo_megatron.config.layout import layout_sizes
    from vapo_megatron.parallel.model_groups import rank_groups

    layout = (config.policy if role == "policy" else config.critic).layout
    sizes = layout_sizes(tp=layout.tp, pp=layout.pp, cp=layout.cp, world_size=world_size)
    return next(list(g) for g in rank_groups(sizes, "cp", "dp") if rank in g)


def _ranks(group: dist.ProcessGroup | None) -> list[int]:
    return [dist.get_rank()] if group is None else dist.get_process_group_ranks(group)


def engine_bytes(engine) -> dict[str, int]:
    """params, param_buffer, grads, optimizer: bytes of the engine's built tensors."""
    from vapo_megatron.checkpoint.optimizer_state import sub_optimizers

    params = [p for chunk in engine.chunks for p in chunk.parameters()]
    model_ids = {id(p) for p in params}
    buffers = [b for chunk in engine.chunks for b in chunk.buffers + chunk.expert_parallel_buffers]
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    optimizer = 0
    for opt in sub_optimizers(engine.optimizer):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                # Main copies: a view (the fp32 distributed optimizer's shard of the model's
                # own buffer) or a model parameter (the plain fp32 optimizer) costs nothing.
                if id(p) not in model_ids and p._base is None:
                    optimizer += nbytes(p)
                state = opt.optimizer.state.get(p, {})
                optimizer += sum(nbytes(v) for k, v in state.items() if k != "step")
    return {
        "params": sum(nbytes(p) for p in params),
        "param_buffer": sum(nbytes(b.param_data) for b in buffers if b.param_data is not None),
        "grads": sum(nbytes(b.grad_data) for b in buffers),
        "optimizer": optimizer,
    }


def synthetic_token_counts(config: TrainConfig) -> list[int]:
    """Tokens (prompt + response) of each sample of a synthetic step of the recipe's shape:
    prompts of 1/4 to all of data.max_prompt_tokens, responses of 1 to
    rollout.max_new_tokens, uniform and seeded by trainer.seed (group sampling: the samples of
    one prompt share its length)."""
    rng = random.Random(config.trainer.seed)
    algo, max_prompt = config.algorithm, config.data.max_prompt_tokens
    counts = []
    for _ in range(algo.prompts_per_step):
        prompt = rng.randint(max(1, max_prompt // 4), max_prompt)
        for _ in range(algo.samples_per_prompt):
            counts.append(prompt + rng.randint(1, config.rollout.max_new_tokens))
    return counts


def data_path(config: TrainConfig, engines: dict) -> tuple[str, str]:
    """(path, reason) a VAPO step takes at this rank (``outputs.choose_path`` on the built
    engines; the agreement over ranks is a no-op under the fake backend)."""
    from vapo_megatron.step.outputs import choose_path

    scorers = [engines[role] for role in _roles(config)]
    choice = choose_path(scorers, host_group=dist.group.WORLD)
    return choice.name, choice.reason


def _data_share(config: TrainConfig, engine, counts: list[int], path: str) -> dict[str, int]:
    """This DP rank's share of the synthetic step: the samples it owns for the whole step
    (the first epoch's mini-batches split by tokens over this model's DP size; ``path`` does
    not change it)."""
    from vapo_megatron.data.packing import Sample
    from vapo_megatron.step.batching import plan_micro_batches
    from vapo_megatron.step.scoring_pass import step_share
    from vapo_megatron.step.updates import minibatch_indices

    num_minibatches = max(1, len(counts) // config.trainer.mini_batch_size)
    parts = minibatch_indices(len(counts), num_minibatches, config.trainer.seed * 1_000_003)
    lengths = torch.tensor(counts, dtype=torch.long, device=HOST)  # the ids ignore it
    share = step_share(
        parts, counts, lengths, dp_size=engine.dp_size, dp_rank=engine.dp_rank
    ).ids.tolist()
    # Shapes only: the planner reads lengths, so the tokens stay on meta.
    samples = [
        Sample(prompt=torch.empty(1, device=META), response=torch.empty(counts[i] - 1, device=META))
        for i in share
    ]
    batches = 0
    if samples:
        plan = plan_micro_batches(
            samples, engine.layout, token_budget=config.trainer.micro_batch_tokens
        )
        batches = len(plan.groups)
    return {
        "samples": len(share),
        "tokens": sum(counts[i] for i in share),
        "micro_batches": batches,
    }


def dry_run(
    config: TrainConfig,
    hf: HFModelConfig,
    *,
    world_size: int,
    ranks: Sequence[int],
    critic_hf: HFModelConfig | None = None,
) -> list[RankReport]:
    """Stand in for each of ``ranks`` of a ``world_size``-rank job (module doc), the critic
    built from ``critic_hf`` (critic.model's config; None: the policy's). ValueError with the
    real run's message where the recipe cannot run at this size."""
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad or not ranks:
        raise ValueError(
            f"--ranks {list(ranks)}: each must be in 0..{world_size - 1} (--world-size "
            f"{world_size}); give at least one"
        )
    config.check(world_size)  # before any layout arithmetic: the real run's first refusal
    job_size, world_size = world_size, trainer_world(config, world_size)
    if any(rank >= world_size for rank in ranks):
        raise ValueError(
            f"--ranks {list(ranks)}: under rollout.placement=separate ranks {world_size}.."
            f"{job_size - 1} only generate (no model is built there); stand in for trainer "
            f"ranks 0..{world_size - 1}"
        )
    roles = _roles(config)
    counts = synthetic_token_counts(config)
    work = planner_workload(config, world_size)
    models = {"policy": hf, "critic": critic_hf or hf}
    peer_cache: dict[tuple[str, int], tuple[list, list]] = {}

    def peer_shards(role: str, rank: int) -> tuple[list, list]:
        if (role, rank) not in peer_cache:
            with stand_in_for(rank, world_size):
                model_sd, optimizer_sd = _checkpoint_shards(
                    _build(config, models, [role]).engines[role]
                )
                peer_cache[role, rank] = (_shards(model_sd), _shards(optimizer_sd))
        return peer_cache[role, rank]

    reports = []
    for rank in ranks:
        peers = {role: _dp_cp_peers(config, role, rank, world_size) for role in roles}
        for role in roles:  # each peer is a world of its own: built before this rank's
            for peer in peers[role]:
                if peer != rank:
                    peer_shards(role, peer)
        with stand_in_for(rank, world_size):
            built = _build(config, models, roles)
            path, reason = data_path(config, built.engines)
            report = RankReport(rank=rank, world_size=world_size, data_path=f"{path} ({reason})",
                                **_replica(config, rank, job_size))  # fmt: skip
            for role in roles:
                engine, groups = built.engines[role], built.groups[role]
                model_sd, optimizer_sd = _checkpoint_shards(engine)  # Adam's moments made
                peer_cache[role, rank] = (_shards(model_sd), _shards(optimizer_sd))
                lists = [peer_cache[role, p] for p in peers[role]]
                dp_cp = groups.pg_collection.dp_cp
                weights = _written(model_sd, dp_cp, [m for m, _ in lists])
                optimizer = _written(optimizer_sd, dp_cp, [o for _, o in lists])
                checkpoint = {
                    "weights_bytes": _nbytes(weights), "weights_tensors": len(weights),
                    "optimizer_bytes": _nbytes(optimizer), "optimizer_tensors": len(optimizer),
                    "group_tensors": sum(len(m) + len(o) for m, o in lists),
                }  # fmt: skip
                figures = _figures(role, engine, groups, checkpoint, hf=models[role], work=work)
                data = _data_share(config, engine, counts, path)
                report.models.append(ModelFigures(**figures, data=data))
            reports.append(report)
    return reports


def trainer_world(config: TrainConfig, world_size: int) -> int:
    """Ranks of a ``world_size``-rank job the models are built over: all of them colocated,
    the trainer ranks (the first world - rollout.ranks) under the separate placement."""
    return world_size - config.rollout.rollout_world(world_size)


def _replica(config: TrainConfig, rank: int, world_size: int) -> dict[str, Any]:
    """RankReport's vLLM fields of ``rank`` in a ``world_size``-rank job."""
    k = config.rollout.tensor_parallel_size
    prompts = config.algorithm.prompts_per_step
    if config.rollout.placement == "separate":
        trainers = trainer_world(config, world_size)
        return {"replica": None, "replica_ranks": list(range(trainers, world_size)),
                "replica_prompts": prompts}  # fmt: skip
    share = replica_share(prompts, world_size // k, rank // k)
    return {"replica": rank // k, "replica_ranks": list(range(rank // k * k, rank // k * k + k)),
            "replica_prompts": len(share)}  # fmt: skip


def _figures(
    role: str, engine, groups, checkpoint: dict[str, int], *, hf: HFModelConfig, work
) -> dict[str, Any]:
    """ModelFigures' fields (but data) of one built engine, the planner's beside them."""
    head = "lm" if role == "policy" else "value"
    layout, pp_rank = engine.layout, groups.pp_rank
    stage = mp.stage_state(hf, layout, work, head=head, pp_rank=pp_rank)
    built = engine_bytes(engine)
    built["checkpoint"] = checkpoint["weights_bytes"] + checkpoint["optimizer_bytes"]
    pg = groups.parallel
    experts = {}  # MoE under expert parallelism: megatron's expert groups too
    if groups.ep_size > 1:
        experts = {"ep": groups.ep_size, "etp": groups.etp_size, "edp": groups.edp_size}
    return {
        "role": role,
        "layout": {"tp": groups.tp_size, "pp": groups.pp_size, "cp": groups.cp_size,
                   "dp": groups.dp_size, **({"vpp": layout.vpp} if layout.vpp else {}),
                   **experts},
        "coords": {"tp": groups.tp_rank, "pp": pp_rank, "cp": groups.cp_rank,
                   "dp": groups.dp_rank,
                   **({"ep": groups.ep_rank, "etp": groups.etp_rank} if experts else {})},
        "groups": {
            **{name: _ranks(getattr(pg, name)) for name in ("tp", "pp", "cp", "dp", "dp_cp")},
            **{name: _ranks(getattr(groups.pg_collection, name))
               for name in (("ep", "expt_dp") if experts else ())},
        },
        "param_count": sum(p.numel() for c in engine.chunks for p in c.parameters()),
        "built": built,
        "planned": {
            "params": stage.params, "grads": stage.grads, "optimizer": stage.optimizer,
            "checkpoint": checkpoint_bytes(hf, layout, work, head=head, pp_rank=pp_rank,
                                           tp_rank=groups.tp_rank),
        },
        "planned_param_count": shard_param_count(
            hf, layout, head=head, pp_rank=pp_rank, mtp=work.builds_mtp(head)
        ),
        "checkpoint": checkpoint,
    }  # fmt: skip
