"""Code that runs inside vLLM's worker processes: the weight-transfer backend and a few probes.

vLLM imports this module in every worker (it is the engine's ``worker_extension_cls``)
before the model is built, which is what registers the ``vapo_inline`` weight-transfer
backend there; in-process (TP=1) the engine module imports it itself. Keep it small and
free of project imports: it is loaded by vLLM's workers, not by the trainer's code paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.distributed.weight_transfer import WeightTransferEngine, WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import (
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

INLINE_BACKEND = "vapo_inline"


@dataclass
class InlineInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the tensors travel inside the RPC message."""


@dataclass
class InlineUpdateInfo(WeightTransferUpdateInfo):
    weights: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    """One bucket of (HF name, full tensor) pairs."""


class InlineWeightTransferEngine(WeightTransferEngine[InlineInitInfo, InlineUpdateInfo]):
    """Weight-transfer backend whose chunks carry the CPU tensors themselves.

    In-process (TP=1) the tensors are passed by reference. With worker processes (TP>1)
    vLLM's RPC queue pickles CPU tensors out of band through shared memory, so each rank
    receives the full tensor and vLLM's loaders fuse q/k/v and gate/up and slice for the
    rank. One update is a session: ``start`` puts every layer in layerwise-reload mode,
    each chunk is buffered per layer until the layer is complete (so chunk boundaries may
    fall anywhere, even between q_proj and k_proj), ``finish`` processes what is left.
    vLLM's built-in ``ipc`` and ``nccl`` backends need a GPU.
    """

    init_info_cls = InlineInitInfo
    update_info_cls = InlineUpdateInfo

    def init_transfer_engine(self, init_info: InlineInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        cpu_moe_layers(self.model)  # refuses a padded CPU MoE before any layer is touched
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: InlineUpdateInfo) -> None:
        self.model.load_weights(update_info.weights)

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)
        repack_cpu_moe_weights(self.model)

    def shutdown(self) -> None:
        pass


try:
    WeightTransferEngineFactory.register_engine(INLINE_BACKEND, InlineWeightTransferEngine)
except ValueError:  # already registered: this module was imported before in this process
    pass


def cpu_moe_layers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, object]]:
    """(layer, its ``CPUUnquantizedExperts``) of each of vLLM-CPU's prepacked MoE layers; empty
    on a GPU build. Raises when one is padded: vLLM 0.32's CPU MoE rounds each rank's expert
    width up to a multiple of 32 at the first load (``CPUUnquantizedExperts.
    _pad_moe_intermediate``), and its layerwise reload then fails copying the unpadded new
    weights into the padded ones (``model_loader/reload/layerwise.py::
    _copy_and_restore_kernel_tensors``: "The size of tensor a (64) must match the size of
    tensor b (32)"; a width-32 expert at vLLM TP 2)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM build without the CPU MoE kernels (GPU)
        return []
    layers = []
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or experts._use_zentorch:
            continue
        config = experts.moe_config
        width = config.intermediate_size_per_partition
        if experts._padded_intermediate_size(config) != width:
            raise ValueError(
                f"vLLM-CPU pads this MoE's expert width per rank, {width}, to a multiple of 32 "
                "for its kernel, and weight updates into a padded CPU MoE fail: pick a "
                "moe_intermediate_size that is a multiple of 32 x the vLLM TP size"
            )
        layers.append((module, experts))
    return layers


def repack_cpu_moe_weights(model: torch.nn.Module) -> int:
    """Prepack again the routed experts of vLLM-CPU's MoE layers after a weight update; return
    how many layers were repacked.

    vLLM 0.32 prepacks CPU MoE weights into its grouped-GEMM layout once, at the first load
    (``CPUUnquantizedExperts.process_weights_after_loading``, reached from
    ``UnquantizedFusedMoEMethod._setup_kernel`` only when ``moe_kernel`` is None); on a weight
    update (``is_weight_update``) ``_setup_kernel`` copies the new weights, unpacked, into the
    packed parameters and skips the prepack, so the kernel reads HF-layout rows as packed ones
    and generates garbage. Found by a Qwen3-MoE sync test (tests/integration/weights/
    test_sync_moe.py). GPU kernels take the copied layout as is: nothing to do there."""
    layers = cpu_moe_layers(model)
    if not layers:
        return 0
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import cpu_prepack_moe_weight

    for module, experts in layers:
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(module, name)
            weight.data.copy_(cpu_prepack_moe_weight(weight.data.clone(), experts.isa))
    return len(layers)


def _proc_status_bytes(*keys: str) -> dict[str, int]:
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in keys:
                values[key] = int(value.split()[0]) * 1024  # reported in kB
    return values


class RolloutWorkerExtension:
    """Methods vLLM adds to each worker, called with ``collective_rpc(name)``."""

    def vapo_reset_peak_memory(self) -> int:
        """Reset this process's peak resident memory (Linux ``clear_refs``); return current RSS."""
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return _proc_status_bytes("VmRSS")["VmRSS"]

    def vapo_peak_memory(self) -> int:
        """Peak resident memory of this process since the last reset, in bytes."""
        return _proc_status_bytes("VmHWM")["VmHWM"]
