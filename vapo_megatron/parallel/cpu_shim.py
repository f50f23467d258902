"""Run megatron-core 0.16.1 on CPU with the gloo backend.

Megatron-core calls CUDA directly in about twenty places. ``apply_cpu_shim()`` makes each of
them mean "the CPU" when no CUDA device is present, and does nothing on a GPU machine. Every
replacement below is exercised by ``tests/distributed/test_cpu_shim.py``. Call sites, by file
under ``megatron/core/`` and function:

1. Process-wide patches, only of calls that cannot succeed without CUDA (they raise), so code
   that worked before behaves the same:

   - ``torch.cuda.current_device()`` returns ``torch.device("cpu")``; Megatron passes it as
     ``device=``: ``distributed/param_and_grad_buffer.py`` ``_ParamAndGradBuffer.__init__``
     (DDP grad and param buffers), ``pipeline_parallel/p2p_communication.py``
     ``create_tensor_recv_prev``/``_next`` (receive buffers), ``utils.py``
     ``GlobalMemoryBuffer.get_tensor``, ``models/common/embeddings/rotary_pos_embedding.py``
     ``RotaryEmbedding.get_emb`` (moves ``inv_freq``), ``dist_checkpointing/strategies/
     state_dict_saver.py`` ``save_state_dict_async_finalize`` (failure flag after a save);
     also the weights and all-gather buffers of ``tensor_parallel/layers.py`` and
     ``mappings.py`` without ``use_cpu_initialization`` or with sequence parallelism.
   - ``torch.cuda.synchronize()`` does nothing: ``pipeline_parallel/p2p_communication.py``
     ``_communicate`` (after batched isend/irecv, ``batch_p2p_sync``) and
     ``dist_checkpointing/strategies/filesystem_async.py`` ``preload_tensors`` (every save).
     Gloo work is complete once its request is waited on.
   - ``Tensor.cuda()`` returns the tensor: ``models/common/language_module/
     language_module.py`` ``setup_embeddings_and_output_layer`` (tied embeddings under PP:
     the last stage's copy before its all-reduce) and ``models/common/embeddings/
     rope_utils.py`` ``get_pos_emb_on_this_cp_rank`` (RoPE chunk index under CP).

2. ``device="cuda"`` and ``pin_memory=True`` in tensor factories. Wrapping ``torch.zeros``
   and friends process-wide would tax every library, so these Megatron modules get, as their
   global ``torch``, a view of torch whose ``tensor``/``zeros``/``ones`` put "cuda" tensors on
   the CPU and skip pinning (it needs an accelerator); every other attribute is torch's own:

   - ``pipeline_parallel/schedules.py``: ``total_num_tokens`` in
     ``forward_backward_no_pipelining``, ``forward_backward_pipelining_without_interleaving``
     and ``forward_backward_pipelining_with_interleaving``.
   - ``transformer/utils.py`` ``get_default_causal_mask`` (local attention without a mask).
   - ``utils.py`` ``local_multi_tensor_l2_norm`` (grad norm without apex or TE).
   - ``optimizer/clip_grads.py`` ``get_grad_norm_fp32``, ``clip_grad_by_total_norm_fp32``.
   - ``optimizer/optimizer.py`` ``MixedPrecisionOptimizer.__init__`` (``_dummy_overflow_buf``,
     ``_scale_one``; bf16 and the distributed optimizer) and ``FP32Optimizer.__init__``.
   - ``models/common/embeddings/rope_utils.py`` ``get_pos_emb_on_this_cp_rank`` (pinning).
   - ``tensor_parallel/random.py``, whose ``torch.cuda`` is a view as well:
     ``get_rng_state`` and ``manual_seed`` act on the CPU generator
     (``CudaRNGStatesTracker.add``, ``model_parallel_cuda_manual_seed``).

3. Random-number state, ``tensor_parallel/random.py``. The "CUDA" generator Megatron tracks
   becomes the CPU default generator, the one dropout and ``use_cpu_initialization`` draw from:

   - ``_get_cuda_rng_state`` returns ``torch.get_rng_state()``.
   - ``_set_cuda_rng_state`` calls ``torch.set_rng_state`` now. The original defers the set
     through ``torch.cuda._lazy_call``, which never runs without CUDA: each tracker
     ``fork()`` queued two closures for good and did not isolate the stream, and
     ``model_parallel_cuda_manual_seed`` left the generator at a TP-rank-dependent seed, so
     TP=2 initialised differently from TP=1.
   - ``CudaRNGStatesTracker.fork`` logs "CPU RNG state changed within GPU RNG context" when
     the fork draws numbers. Here that change is the fork's purpose: the message is filtered.

4. CUDA type names. Megatron sorts parameters by ``tensor.type()`` compared with
   ``'torch.cuda.FloatTensor'`` and friends (else ``TypeError: Wrapped parameters must be one
   of torch.cuda.FloatTensor...``). While these run, CPU tensors answer ``.type()`` with the
   CUDA name, through a ``TorchFunctionMode`` entered for the call only:
   ``optimizer/distrib_optimizer.py`` ``DistributedOptimizer.__init__`` (and the
   ``_build_model_and_main_param_groups`` it calls), ``optimizer/optimizer.py``
   ``Float16OptimizerWithFloat16Params.__init__`` (bf16 without the distributed optimizer)
   and ``optimizer/clip_grads.py`` ``clip_grad_by_total_norm_fp32`` (also bound by name in
   ``optimizer/optimizer.py``).

Not one process-wide ``TorchFunctionMode`` rewriting devices everywhere: a mode is
thread-local (other threads escape it), taxes every torch call in the process (vLLM and
transformers share it) and gets in the way of ``torch.compile``.

Left alone on purpose: ``torch.cuda.empty_cache`` is already a no-op without CUDA; NVTX ranges
only run after ``megatron.core.utils.configure_nvtx_profiling(True)``; CUDA streams only serve
several distributed-optimizer instances and CUDA graphs; the remaining CUDA tensors belong to
fp16 loss scaling, MoE, inference, FSDP, NCCL user buffers, offloading optimizer state or
buffers, and cached checkpoint plans, none of which this project runs on CPU.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from vapo_megatron.parallel.groups import ParallelGroups

_applied = False


def apply_cpu_shim() -> bool:
    """Make megatron-core run on CPU; return whether the shim is active.

    Returns ``False`` and changes nothing when CUDA is available. Safe to call repeatedly.
    """
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        _patch_torch_cuda()
        _patch_megatron()
        _applied = True
    return True


def initialize_cpu_process_group() -> None:
    """Start the gloo process group (once per process) and apply the shim.

    Reads ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``. Enough for models built on
    their own groups (``parallel.model_groups.build_model_groups``); ``parallel_state`` stays
    uninitialised.
    """
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    apply_cpu_shim()


def initialize_megatron_cpu(
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    vpp: int | None = None,
    seed: int = 1234,
    *,
    ep: int = 1,
    etp: int | None = None,
) -> ParallelGroups:
    """Set up megatron-core's parallel state on CPU for this rank and return its groups.

    Starts the gloo process group (:func:`initialize_cpu_process_group`), initialises
    ``parallel_state`` with the given tensor/pipeline/context/virtual-pipeline sizes (data
    parallelism takes the remaining ranks) and expert-parallel / expert-TP sizes (``etp``
    None: TP, megatron's default), and seeds Megatron's RNG tracker. Calling it again
    switches to the new layout and keeps the process group, so one launch can compare several
    layouts.
    """
    # Megatron is imported on first use (it takes seconds), as in ``groups.py``.
    from megatron.core import parallel_state, tensor_parallel

    initialize_cpu_process_group()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    # build_model_groups may have created the scratch buffer this would create again.
    parallel_state.destroy_global_memory_buffer()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ParallelGroups.from_parallel_state()


def destroy() -> None:
    """Tear down ``parallel_state`` and the process group (end every worker with it)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _nothing_to_synchronize(*args: Any, **kwargs: Any) -> None:
    return None


def _stay_on_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


def _patch_torch_cuda() -> None:
    torch.cuda.current_device = _cpu_device
    torch.cuda.synchronize = _nothing_to_synchronize
    torch.Tensor.cuda = _stay_on_cpu


def _cpu_factory(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``factory`` with ``device="cuda"`` mapped to the CPU and ``pin_memory`` dropped."""

    @functools.wraps(factory)
    def make(
        *args: Any, device: Any = None, pin_memory: bool = False, **kwargs: Any
    ) -> torch.Tensor:
        if device is None or str(device).startswith("cuda"):
            device = "cpu"  # this shim runs only without CUDA: the host is the device
        return factory(*args, device=device, **kwargs)

    return make


class _View(types.ModuleType):
    """A module that forwards every attribute it does not define to ``target``."""

    def __init__(self, target: types.ModuleType, **overrides: Any) -> None:
        super().__init__(target.__name__)
        self._target = target
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


def _cpu_torch_view() -> _View:
    """``torch`` as seen by the Megatron modules that hard-code CUDA tensors."""
    cuda = _View(
        torch.cuda,
        get_rng_state=torch.get_rng_state,
        manual_seed=torch.manual_seed,
    )
    return _View(
        torch,
        cuda=cuda,
        tensor=_cpu_factory(torch.tensor),
        zeros=_cpu_factory(torch.zeros),
        ones=_cpu_factory(torch.ones),
    )


def _get_rng_state(
    device: Any = "cuda", clone: bool = False, graph_safe: bool = False
) -> torch.Tensor:
    """CPU stand-in for ``tensor_parallel.random._get_cuda_rng_state`` (always a copy)."""
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """CPU stand-in for ``tensor_parallel.random._set_cuda_rng_state``: set it now."""
    torch.set_rng_state(new_state)


class _CudaTypeNames(TorchFunctionMode):
    """CPU and meta tensors answer ``.type()`` with the CUDA type name Megatron compares
    against."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Meta tensors (the dry run, planning/dry_run.py) say "torch.meta.*".
            return result.replace("torch.meta.", "torch.", 1).replace("torch.", "torch.cuda.", 1)
        return result


def _with_cuda_type_names(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with _CudaTypeNames():
            return fn(*args, **kwargs)

    return wrapped


class _DropForkWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _patch_megatron() -> None:
    from megatron.core import utils as core_utils
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer import utils as transformer_utils

    view = _cpu_torch_view()
    for module in (
        schedules,
        transformer_utils,
        core_utils,
        clip_grads,
        optimizer,
        rope_utils,
        random,
    ):
        module.torch = view

    random._get_cuda_rng_state = _get_rng_state
    random._set_cuda_rng_state = _set_rng_state
    logging.getLogger(random.__name__).addFilter(_DropForkWarning())

    clip_by_norm = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = clip_by_norm
    optimizer.clip_grad_by_total_norm_fp32 = clip_by_norm
    for cls in (
        distrib_optimizer.DistributedOptimizer,
        optimizer.Float16OptimizerWithFloat16Params,
    ):
        cls.__init__ = _with_cuda_type_names(cls.__init__)
