"""The rollout engine: vLLM, offline and in the trainer's process, refreshed from the trained weights.

One ``RolloutEngine`` is created per run on every rank. Inside a distributed job (the trainer
under torchrun or the local launcher) the engines are vLLM's ``external_launcher`` executor:
with vLLM TP k, each k consecutive ranks of the world form one engine replica whose workers
are those ranks' own processes, and the world / k replicas generate independently (TP 1 is
the case k = 1: one replica per rank). Each step the trainer streams the policy's full
HF-named tensors into every rank (``update_weights``: an in-process handoff, each rank's vLLM
worker slices its TP part), generates (``generate``), and on GPU puts the engine to sleep
while training (``sleep``/``wake_up``, in the order ``sleep_state`` enforces). See
docs/rollout.md for the choices made here and the numbers behind them.
"""

from __future__ import annotations

import os
import random
import time
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist

from vapo_megatron.rollout.module_tensors import (
    restore_unsaved_module_tensors,
    save_unsaved_module_tensors,
)
from vapo_megatron.rollout.output_rank import (
    engine_scheduler,
    leave_routes_to_output_rank,
    vllm_tp_rank,
)
from vapo_megatron.rollout.prefetch import Prefetcher
from vapo_megatron.rollout.route_recorder import ROUTE_DTYPE, RouteRecorder
from vapo_megatron.rollout.sleep_state import SleepLevel, SleepState, TrainingStateOffload
from vapo_megatron.rollout.vllm_args import (
    check_vllm_version,
    cpu_rotary_embedding,
    cpu_scheduling,
    cpu_thread_binding,
    group_timeouts,
    replica_and_executor,
    route_recording,
    sleep_mode,
)

WORKER_EXTENSION = "vapo_megatron.rollout.worker_extension.RolloutWorkerExtension"


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """How the rollout engine is built. Sampling values are arguments of ``generate``."""

    model_path: str
    """HF model directory (config.json + weights) the engine starts from; later steps overwrite the weights."""
    tensor_parallel_size: int = 1
    """vLLM TP per engine. In a distributed job: each this many consecutive ranks form one replica
    (external_launcher, every worker in a trainer rank). Without one: 1 in-process, >1 worker processes."""
    dtype: str = "bfloat16"
    """Engine weights and activations ('bfloat16', 'float16', 'float32'); tensors sent by update_weights are cast to it."""
    max_model_len: int = 4096
    """Longest prompt + response the engine accepts."""
    seed: int = 0
    """Seed of vLLM's own initialisation and unseeded sampling; must be equal on the ranks of one
    replica (they sample in lockstep). Sampling seeds are passed to generate."""
    kv_cache_bytes: int | None = None
    """KV-cache size per rank. None: 1 GiB on CPU (vLLM's CPU default reserves most of host RAM); on GPU, gpu_memory_utilization decides."""
    gpu_memory_utilization: float = 0.5
    """GPU only: the share of device memory vLLM may take (the trainer shares the device)."""
    enforce_eager: bool = True
    """Skip torch.compile and CUDA graphs. Start-up is seconds instead of minutes; set False on GPU for speed."""
    weight_bucket_bytes: int = 256 << 20
    """Bytes per weight-sync message; the extra memory of a sync is about one bucket per rank."""
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    """Which log-probs generate returns: the model's own distribution (temperature 1, no top-p), or the one sampled from."""
    load_format: Literal["auto", "dummy"] = "auto"
    """'auto': read model_path's weights at start; 'dummy': random weights of the right shapes
    (the trainer's engines: the first sync overwrites every weight, so no rank reads the
    checkpoint, 65 GB at 32B, only to discard it). Evaluation of a saved model keeps 'auto'."""
    dist_timeout: timedelta | None = None
    """In a distributed job: how long a collective of vLLM's own process groups may wait
    (vLLM's ``distributed_timeout_seconds`` for its device groups and
    ``cpu_distributed_timeout_seconds`` for their gloo twins); None: torch's defaults (NCCL 10
    minutes, gloo 30)."""
    sleep_level: SleepLevel = 1
    """GPU: what sleep frees. 1: weights to host memory (a pinned copy, 16 GB per rank at 32B),
    KV cache dropped, weights valid on wake; 2: both dropped (a full sync must follow every wake;
    the engine restores what the sync does not, ``sleep_state``). The trainer's default is 2
    (``rollout.sleep_level``: it syncs every step). CPU: vLLM has no sleep mode; only the order
    is checked."""

    record_routes: bool = False
    """MoE models: return each sample's routed experts (routing replay): vLLM's own on GPU,
    ``rollout/route_recorder.py`` on CPU (prefix caching off there)."""

    def __post_init__(self) -> None:
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(
                f"dtype must be 'bfloat16', 'float16' or 'float32', got {self.dtype!r}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.weight_bucket_bytes <= 0:
            raise ValueError(f"weight_bucket_bytes must be > 0, got {self.weight_bucket_bytes}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0 or null, got {self.kv_cache_bytes}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {self.sleep_level!r}")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(
                "logprobs_mode must be 'raw_logprobs' or 'processed_logprobs', "
                f"got {self.logprobs_mode!r}"
            )


@dataclass(frozen=True, kw_only=True)
class RolloutSample:
    """One generated response."""

    prompt_index: int
    """Index of its prompt in the list given to generate."""
    sample_index: int
    """Which of the n samples of that prompt (0..n-1)."""
    response_token_ids: array
    """Generated tokens, [L], an ``array('i')`` (4 bytes a token, where vLLM's list of Python
    ints takes ~36; the trainer copies it into the step's buffers with one memcpy). Ends with
    the stop token when finish_reason is 'stop'."""
    logprobs: array
    """vLLM's log-prob of each generated token, [L], an ``array('f')`` (see
    RolloutConfig.logprobs_mode)."""
    finish_reason: Literal["stop", "length"]
    """'stop': a stop token was generated; 'length': max_new_tokens (or max_model_len) was reached."""
    routes: torch.Tensor | None = None
    """With ``record_routes``, on a replica's first rank: int16 [P + L - 1, layers, top_k], the
    routed experts of every token the engine forwarded (the prompt, then the response but its
    last token), vLLM's ``CompletionOutput.routed_experts`` layout
    (``rollout/route_recorder.py``); else None (the replica's other ranks too)."""


@dataclass(frozen=True, kw_only=True)
class WeightUpdateStats:
    """What one update_weights call moved."""

    num_tensors: int
    num_bytes: int
    num_buckets: int
    seconds: float
    load_seconds: float = 0.0
    """Of ``seconds``, the time inside the engine's loaders (the rest: producing the stream)."""
    wait_seconds: float = 0.0
    """Of ``seconds``, the time spent waiting for the next bucket (with prefetch: the part of the
    stream the engine's loads did not hide; without: all of producing the stream)."""


def _as_loaded(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as the engine loads it: detached, floating point in the engine's dtype."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    tensor = tensor.detach()
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


class _Inline:
    """The iterator interface of ``Prefetcher`` without a thread: items are produced in the
    consumer, on demand; ``wait_seconds`` is the time spent producing them."""

    def __init__(self, items: Iterable) -> None:
        self._items = iter(items)
        self.wait_seconds = 0.0

    def __iter__(self) -> _Inline:
        return self

    def __next__(self):
        start = time.perf_counter()
        try:
            return next(self._items)
        finally:
            self.wait_seconds += time.perf_counter() - start

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc_info: object) -> None:
        close = getattr(self._items, "close", None)
        if close is not None:
            close()


class RolloutEngine:
    """vLLM's offline engine with the engine core in this process.

    In a distributed job ('external_launcher' executor) every rank builds its engine at the
    same time (vLLM creates its groups over the world, collectively) and every rank of a
    replica calls ``generate`` and ``update_weights`` with the same arguments: the ranks of one
    replica run the same deterministic scheduler on the same requests and meet in vLLM's TP
    collectives. Without a process group: TP=1 runs in this process ('uni'), TP>1 starts one
    worker process per rank ('mp', ~25 s on 2 cores). Weight updates go through vLLM's
    weight-transfer API with the ``vapo_inline`` backend (worker_extension.py).

    ``training_offload``: training memory moved to host while the engine is awake (the
    trainer's ``engine/offload.py::TrainingOffload``; GPU only).
    """

    def __init__(
        self, config: RolloutConfig, *, training_offload: TrainingStateOffload | None = None
    ) -> None:
        import vllm
        import vllm.envs

        check_vllm_version(vllm.__version__, os.path.dirname(vllm.__file__))
        from vllm.platforms import current_platform

        # Importing registers the weight-transfer backend in this process (the TP=1 worker).
        import vapo_megatron.rollout.worker_extension  # noqa: F401
        from vapo_megatron.rollout.token_ids_renderer import TOKEN_IDS_MODE

        self.config = config
        self.is_cpu = current_platform.is_cpu()
        self.state = SleepState()
        self.training_offload = training_offload
        tp = config.tensor_parallel_size
        self.in_job = dist.is_initialized()
        self.replica, self.replica_rank, executor = replica_and_executor(tp, self.in_job)
        # The engine core runs in this process, so collective_rpc reaches the workers
        # directly: tensors are passed by reference (in a job, and TP=1) or through vLLM's
        # shared-memory queue ('mp') instead of being serialised to an engine-core process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if self.is_cpu and executor == "mp":
            cores = sorted(os.sched_getaffinity(0))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_thread_binding(tp, cores))
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        # vLLM caches its environment once an engine has started; re-read it for this one.
        vllm.envs.disable_envs_cache()
        kv_cache_bytes = config.kv_cache_bytes
        if kv_cache_bytes is None and self.is_cpu:
            kv_cache_bytes = 1 << 30

        # vLLM seeds Python's, NumPy's and torch's global generators while starting; in
        # this process they belong to the trainer, so give them back as they were.
        rng_states = random.getstate(), np.random.get_state(), torch.get_rng_state()
        start = time.perf_counter()
        self.llm = vllm.LLM(
            config.model_path,
            # Prompts and responses are token ids; stop tokens are passed explicitly.
            skip_tokenizer_init=True,
            tokenizer_mode=TOKEN_IDS_MODE,  # no chat-template warmup without a tokenizer
            tensor_parallel_size=tp,
            distributed_executor_backend=executor,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            seed=config.seed,
            load_format=config.load_format,
            enforce_eager=config.enforce_eager,
            kv_cache_memory_bytes=kv_cache_bytes,
            gpu_memory_utilization=config.gpu_memory_utilization,
            **sleep_mode(self.is_cpu),
            logprobs_mode=config.logprobs_mode,
            worker_extension_cls=WORKER_EXTENSION,
            weight_transfer_config={"backend": "vapo_inline"},
            **group_timeouts(config.dist_timeout),
            **cpu_scheduling(config.max_model_len) if self.is_cpu else {},
            **cpu_rotary_embedding() if self.is_cpu else {},
            **route_recording(config.record_routes, is_cpu=self.is_cpu, executor=executor),
        )
        self.start_seconds = time.perf_counter() - start
        random.setstate(rng_states[0])
        np.random.set_state(rng_states[1])
        torch.set_rng_state(rng_states[2])
        self.llm.collective_rpc("init_weight_transfer_engine", args=({},))
        self._start_routes(executor)

    def _start_routes(self, executor: str) -> None:
        """Routing replay's state: the routes' shape on every rank, and where ``generate``
        returns them (a replica's first rank; vLLM's connector, or the CPU recorder)."""
        config = self.config
        self.route_shape: tuple[int, int] | None = None
        """(layers, top_k) of each token's routes with ``record_routes``; else None."""
        if config.record_routes:
            model_config = self.llm.llm_engine.model_config
            self.route_shape = (
                model_config.get_total_num_hidden_layers(),
                model_config.get_num_experts_per_tok(),
            )
        self.returns_routes = config.record_routes and self.replica_rank == 0
        """Whether ``generate`` returns routes here: vLLM returns a replica's routes on its first
        rank only (``rollout/output_rank.py``), and the CPU recorder keeps that contract."""
        self.route_recorder = None
        if config.record_routes and not self.is_cpu:
            tp_rank = vllm_tp_rank(self.replica_rank) if executor == "external_launcher" else 0
            leave_routes_to_output_rank(engine_scheduler(self.llm), tp_rank)
        if self.returns_routes and self.is_cpu:
            self.route_recorder = RouteRecorder()
            self.llm.collective_rpc(self.route_recorder.attach)

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int,
        stop_token_ids: Sequence[int] = (),
        seed: int | None = None,
    ) -> list[RolloutSample]:
        """Sample ``n`` responses per prompt; returned in (prompt, sample) order.

        temperature 0 is greedy. With ``seed``, sample i of prompt p draws from a generator
        seeded with ``seed + p * n + i``: reproducible, and no two samples of one call share
        a stream (one seed for all would give every prompt the same random numbers). The
        caller varies ``seed`` across steps. Without it, vLLM's global generator is used.
        In a job, every rank of the replica passes the same arguments and gets the same samples.
        """
        from vllm import SamplingParams

        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.state.check_generate()
        if not prompt_token_ids:
            return []
        params = [
            SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new_tokens,
                stop_token_ids=list(stop_token_ids),
                seed=None if seed is None else seed + p * n,
                logprobs=0,  # the sampled token's log-prob only
                detokenize=False,
            )
            for p in range(len(prompt_token_ids))
        ]
        prompts = [{"prompt_token_ids": list(ids)} for ids in prompt_token_ids]
        if self.route_recorder is not None:
            self.route_recorder.start()
        try:
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        finally:
            if self.route_recorder is not None:
                self.route_recorder.stop()
        samples = []
        for p, output in enumerate(outputs):
            for completion in sorted(output.outputs, key=lambda c: c.index):
                if completion.finish_reason not in ("stop", "length"):
                    raise RuntimeError(
                        f"prompt {p} sample {completion.index} finished with "
                        f"{completion.finish_reason!r}, expected 'stop' or 'length'"
                    )
                token_ids = array("i", completion.token_ids)
                # Each entry maps token id -> Logprob; with logprobs=0 it holds the sampled token.
                logprobs = array(
                    "f",
                    [
                        entry[token].logprob
                        for token, entry in zip(token_ids, completion.logprobs, strict=True)
                    ],
                )
                samples.append(
                    RolloutSample(
                        prompt_index=p,
                        sample_index=completion.index,
                        response_token_ids=token_ids,
                        logprobs=logprobs,
                        finish_reason=completion.finish_reason,
                        routes=self._routes(output, completion, n),
                    )
                )
        return samples

    def _routes(self, output, completion, n: int) -> torch.Tensor | None:
        """A completion's routed experts, int16 [P + L - 1, layers, top_k] (or None)."""
        if not self.returns_routes:
            return None
        num_tokens = len(output.prompt_token_ids) + len(completion.token_ids)
        if self.route_recorder is not None:
            key = self.route_recorder.request_of(output.request_id, completion.index, n)
            return self.route_recorder.take(key, num_tokens)
        routes = torch.from_numpy(np.asarray(completion.routed_experts).astype(np.int16))
        if routes.shape[0] != num_tokens - 1:
            raise RuntimeError(
                f"vLLM returned routes for {routes.shape[0]} tokens, expected {num_tokens - 1}"
            )
        return routes.to(ROUTE_DTYPE)

    def message_bytes(self, bucket_bytes: int | None = None, prefetch: bool | None = None) -> int:
        """The bytes of one ``update_weights`` message for a sync bounded by ``bucket_bytes``
        (default ``config.weight_bucket_bytes``): all of it, or half with ``prefetch`` (one
        message loading and the next being produced fit in the bound together)."""
        bucket_bytes = bucket_bytes or self.config.weight_bucket_bytes
        return max(1, bucket_bytes // 2) if self.prefetches(prefetch) else bucket_bytes

    def prefetches(self, prefetch: bool | None = None) -> bool:
        """Whether ``update_weights(prefetch=prefetch)`` produces the next message in a thread:
        as given, or by default off on CPU (the two ranks' threads already keep both cores
        busy; overlap measured slower, docs/rollout.md) and on elsewhere (not measured on a
        GPU)."""
        return (not self.is_cpu) if prefetch is None else prefetch

    def update_weights(
        self,
        messages: Iterable[Sequence[tuple[str, torch.Tensor]]],
        *,
        prefetch: bool | None = None,
    ) -> WeightUpdateStats:
        """Load full HF-named tensors into the engine, one message (a bucket of them) at a time,
        as the producer bucketed them (the weight stream, ``weights/stream.py``, sized by
        ``message_bytes``): the engine does not bucket again.

        Any subset of the model's tensors may be sent (the rest keep their values), in any
        order and with message boundaries anywhere: vLLM holds a fused layer's parts (q/k/v,
        gate/up) until the layer is complete, then fuses and slices it for each TP rank.
        Keep each layer's tensors together in the stream: parts of a layer wait in memory
        until the rest arrives. The prefix cache is cleared afterwards, since it holds KV
        computed with the old weights. In a job every rank of the replica sends the same
        tensors (full, not sliced): each rank's worker keeps its TP slice. The weights must be
        awake (``wake_up(["weights"])`` after a sleep), else ``EngineStateError``. An exception
        midway leaves the engine unusable (every later call raises): build a new one.
        Floating-point tensors are cast to the engine's dtype as they are loaded.

        With ``prefetch`` (``prefetches``), ``messages`` is consumed in a producer thread
        (``prefetch.Prefetcher``) one message ahead, so that producing message k+1 (the weight
        stream's gathers) overlaps the engine's load of message k; the stream's collectives
        then all run in that one thread, in the stream's order, and the caller's thread only
        loads. Without it the messages are consumed in this thread.
        """
        prefetch = self.prefetches(prefetch)
        dtype = getattr(torch, self.config.dtype)
        self.state.begin_update()
        ok = False
        start = time.perf_counter()
        num_tensors = num_bytes = num_buckets = 0
        load_seconds = wait_seconds = 0.0
        try:
            self.llm.collective_rpc("start_weight_update")
            with Prefetcher(iter(messages)) if prefetch else _Inline(iter(messages)) as produced:
                for message in produced:
                    bucket = [(name, _as_loaded(name, t, dtype)) for name, t in message]
                    del message
                    loading = time.perf_counter()
                    self.llm.collective_rpc("update_weights", args=({"weights": bucket},))
                    load_seconds += time.perf_counter() - loading
                    num_tensors += len(bucket)
                    num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
                    num_buckets += 1
                    del bucket  # let its buffers go back to the stream before the next arrives
                wait_seconds = produced.wait_seconds
            loading = time.perf_counter()
            self.llm.collective_rpc("finish_weight_update")
            self.llm.reset_prefix_cache()
            load_seconds += time.perf_counter() - loading
            ok = True
        finally:
            self.state.end_update(ok)
        return WeightUpdateStats(
            num_tensors=num_tensors,
            num_bytes=num_bytes,
            num_buckets=num_buckets,
            seconds=time.perf_counter() - start,
            load_seconds=load_seconds,
            wait_seconds=wait_seconds,
        )

    def sleep(self) -> None:
        """Free the engine's device memory for training (vLLM sleep, ``config.sleep_level``),
        then bring training memory back from host if it was offloaded.

        Level 2 first saves, on host, the module tensors that vLLM's level 2 discards and
        neither vLLM nor the weight sync restores (``unsaved_module_tensors``); ``wake_up``
        puts them back with the weights. On CPU vLLM is not called (its CPU worker has no sleep
        mode, and host memory is not the limit there), but the state changes as on GPU:
        generating or syncing before the matching ``wake_up`` is an ``EngineStateError`` on
        CPU too, and the training state moves (to a second host buffer and back) all the same.
        """
        self.state.sleep(self.config.sleep_level)
        if not self.is_cpu:
            if self.config.sleep_level == 2:
                self.llm.collective_rpc(save_unsaved_module_tensors)
            self.llm.sleep(level=self.config.sleep_level)
        if self.training_offload is not None:
            self.training_offload.restore()

    def wake_up(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Bring back the engine's memory, in the order given (weights before the KV cache).

        The step does ``wake_up(["weights"])``, ``update_weights(...)``, then
        ``wake_up(["kv_cache"])``, so that the KV cache is not allocated while the buckets are
        in flight. With a ``training_offload``, everything of the training state but the
        policy's parameters leaves the device before the weights come back, and the policy's
        parameters (read by the sync) before the KV cache. Waking what is awake does nothing.
        On CPU vLLM is not called (see ``sleep``).
        """
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(
                f"wake_up tags must be 'weights' and/or 'kv_cache', got {sorted(unknown)}"
            )
        for tag in tags:
            was_asleep = (
                self.state.weights != "awake" if tag == "weights" else not self.state.kv_cache_awake
            )
            discarded = self.state.weights == "discarded"
            self.state.wake(tag)
            if not was_asleep:
                continue
            if self.training_offload is not None:
                if tag == "weights":
                    self.training_offload.offload_for_weights()
                else:
                    self.training_offload.offload_policy_params()
            if not self.is_cpu:
                self.llm.wake_up(tags=[tag])
                if tag == "weights" and discarded:
                    self.llm.collective_rpc(restore_unsaved_module_tensors)

    def reset_peak_memory(self) -> list[int]:
        """Reset each rank's peak resident memory; return each rank's current RSS in bytes."""
        return self.llm.collective_rpc("vapo_reset_peak_memory")

    def peak_memory(self) -> list[int]:
        """Each rank's peak resident memory in bytes since ``reset_peak_memory``."""
        return self.llm.collective_rpc("vapo_peak_memory")

    def shutdown(self) -> None:
        """Stop the worker processes ('mp') and vLLM's process groups in this process.

        vLLM's parallel state is global to the process, and its teardown destroys
        torch.distributed's default group, the trainer's own when one existed before the
        engine (vLLM adopts it as its world, on every executor): shut down last, on every rank
        together, and only one engine per process at a time. The training offload's host
        arena is freed too when the training state is back on the device (it is whenever the
        engine sleeps); after a failure mid-rollout it is left to the ending process, since
        releasing it would lose the state and raising here would hide the failure.
        """
        self.llm.llm_engine.engine_core.shutdown()
        if self.training_offload is not None and not self.training_offload.offloaded:
            self.training_offload.release()
