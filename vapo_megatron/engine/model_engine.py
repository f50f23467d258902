"""One trained model (policy or critic): DDP-wrapped chunks, optimizer and pipeline schedule.

Loss scaling. Loss functions return this micro-batch's *share of the global loss* (sums divided
by global counts, see ``parallel/reductions.py``), so the gradient we want is the plain sum of
the shares' gradients over micro-batches and data x context ranks. Megatron instead averages:
with a 2-tuple loss the schedule multiplies by cp_size and divides by the number of
micro-batches, and DDP scales gradients by 1 / (dp * cp). The engine multiplies each share by
num_microbatches * dp_size before handing it to Megatron, which cancels both exactly.

Process groups. Each engine runs on its own :class:`ModelGroups` (``parallel/model_groups.py``),
so the policy and the critic can take different layouts over the same ranks; everything here
(model, DDP, optimizer, schedule, weight load/export, log-prob slice) reads the model's groups,
never ``parallel_state``. What megatron still keeps per process is listed in that module.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
)
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from vapo_megatron.checkpoint.model import CheckpointMetadata
from vapo_megatron.checkpoint.state import TrainableState
from vapo_megatron.config.gpu import GpuSettings, resolve
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.moe import MoESettings
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.config.recompute import RecomputeSettings
from vapo_megatron.data.packing import MicroBatch
from vapo_megatron.models.config import Head, HFModelConfig
from vapo_megatron.models.logprobs import VocabSlice
from vapo_megatron.models.megatron_patches import (
    apply_megatron_patches,
    finalize_model_grads_on_model_groups,
)
from vapo_megatron.models.mtp import MTPGPTModel
from vapo_megatron.models.provider import (
    build_model,
    check_local_attention_fits,
    default_layer_spec,
    layer_spec_kind,
    transformer_config,
    uses_grouped_experts,
)
from vapo_megatron.models.router_replay import ModelRouterReplay
from vapo_megatron.parallel.devices import training_device
from vapo_megatron.parallel.model_groups import ModelGroups, seed_rng_tracker
from vapo_megatron.weights.export import BUCKET_BYTES, export_hf
from vapo_megatron.weights.gather import GatherBuffers, gather_hf_weights, load_hf_weights
from vapo_megatron.weights.record import ModelRecord
from vapo_megatron.weights.stream import stream_policy_weights

LossFn = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""(model output [b, s, V/tp] logits or [b, s, 1] values, micro-batch) -> (loss share, metrics)."""


class ModelEngine:
    """This rank's chunks of one model, wrapped for training, with their optimizer.

    ``groups``: this model's process groups (:func:`build_model_groups`); None reads the
    layout megatron-core's ``parallel_state`` was initialised with (one layout per job).
    ``recompute``: activation recompute (``config.recompute.RecomputeSettings``); None: off.
    ``initialize``: False skips megatron's random initialisation, for a caller that loads
    every parameter next (``load_hf`` or a checkpoint; at 32B both models would otherwise be
    drawn on the GPU only to be overwritten). ``moe``: an MoE model's router losses, router
    dtype and dispatcher (None: ``MoESettings()``); its expert groups are ``groups``' (EP and
    expert TP of the layout).

    MoE: megatron marks expert parameters ``allreduce=False``; DDP (``distributed_data_
    parallel.py``) puts them in their own buffers, reduced over the expert-DP group
    (``pg_collection.expt_dp``) and scaled by 1 / (dp * cp) like the dense ones (each expert's
    gradient already sums the tokens its EP group routed to it), and ``get_megatron_optimizer``
    gives them an optimizer of their own over that group (distributed optimizer: sharded over
    expert DP), their grad norm reduced over ``tp_ep_pp``. The router's load-balancing and
    z-losses (``MoESettings``, off by default) reach the gradient through megatron's
    ``MoEAuxLossAutoScaler``, which the schedule scales by cp / num_microbatches
    (``schedules.py`` ``forward_step``): the per-micro-batch mean, outside the loss shares.
    """

    def __init__(
        self,
        hf: HFModelConfig,
        layout: ModelLayout,
        *,
        head: Head,
        optim: OptimSettings,
        groups: ModelGroups | None = None,
        params_dtype: torch.dtype = torch.float32,
        layer_spec: ModuleSpec | None = None,
        gpu: GpuSettings | None = None,
        recompute: RecomputeSettings | None = None,
        initialize: bool = True,
        moe: MoESettings | None = None,
        mtp_loss_weight: float = 0.0,
    ):
        layout.check(hf)
        apply_megatron_patches()  # GQA with fewer KV heads than TP ranks: the model's TP group
        self.hf, self.layout, self.head = hf, layout, head
        self.mtp_loss_weight = mtp_loss_weight
        """> 0: the policy's MTP layers are built in the model and trained with this weight
        (``models/mtp.py``, ``step/losses.py``); 0: none built (carried as files)."""
        self.groups = _checked_groups(layout, groups)
        seed_rng_tracker(self.groups)
        # Fusions and overlaps: all off on CPU. The overlaps' hooks are this engine's: it sets
        # megatron's no_sync_func (_build_chunks) and gathers parameters before reading them
        # (gather_params; gpu_settings.py says why both are needed).
        self.gpu = resolve(
            gpu or GpuSettings(),
            bf16=params_dtype == torch.bfloat16,
            distributed_optimizer=optim.distributed_optimizer,
            overlap_hooks=True,
            name="critic" if head == "value" else "policy",
        )
        if layer_spec is None:
            layer_spec = default_layer_spec(hf, grouped_gemm=self.gpu.moe_grouped_gemm)
        # The record names the parameters of the spec the model is built with (TE fuses norms).
        self.record = ModelRecord(
            hf, head, layer_spec=layer_spec_kind(layer_spec),
            grouped_experts=uses_grouped_experts(layer_spec), mtp=mtp_loss_weight > 0,
        )  # fmt: skip
        self.config = transformer_config(
            hf, layout, params_dtype=params_dtype, gpu=self.gpu,
            recompute=recompute.transformer_config_kwargs() if recompute is not None else None,
            initialize=initialize, moe=moe, mtp=mtp_loss_weight > 0,
        )  # fmt: skip
        # The expert bias's update (sigmoid routers) on this model's groups, not megatron's.
        self.config.finalize_model_grads_func = finalize_model_grads_on_model_groups
        self.device = training_device()
        """Where the model, its inputs and its collectives' tensors live."""
        self.chunks = _build_chunks(
            hf, self.config, self.gpu, head=head, layer_spec=layer_spec, device=self.device,
            distributed_optimizer=optim.distributed_optimizer,
            pg_collection=self.groups.pg_collection,
        )  # fmt: skip
        self.compute_seconds = 0.0
        """Seconds spent in Megatron's schedule (forward/backward) and optimizer steps."""
        self.optimizer = _build_optimizer(
            optim, self.chunks, self.gpu, params_dtype=params_dtype,
            pg_collection=self.groups.pg_collection,
        )  # fmt: skip
        self.scheduler = _build_scheduler(self.optimizer, optim)
        self.router_replay: ModelRouterReplay | None = None
        """MoE with routing replay (``track_routes``): this model's own RouterReplay set."""
        self.replay_routes = False
        self.recorded_routes: list[torch.Tensor] = []
        """The last ``run(record_routes=True)``'s routes per micro-batch (``run``)."""

    def track_routes(self, *, replay: bool) -> None:
        """MoE: drive this model's routers with each micro-batch's routes (the ``ROUTES``
        field, ``models/router_replay.py``): replayed in the forward and its recompute when
        ``replay``, else only compared with the router's own top-k (the agreement metric)."""
        self.router_replay = ModelRouterReplay(self.chunks)
        self.replay_routes = replay

    @property
    def tp_rank(self) -> int:
        """This rank's index in the model's tensor-parallel group."""
        return self.groups.tp_rank

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage in the model."""
        return self.groups.pp_rank

    @property
    def cp_rank(self) -> int:
        """This rank's index in the model's context-parallel group."""
        return self.groups.cp_rank

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica of the model."""
        return self.groups.dp_rank

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas of the model."""
        return self.groups.dp_size

    @property
    def is_first_stage(self) -> bool:
        """This rank holds the model's first pipeline stage (the embedding)."""
        return self.groups.is_first_stage

    @property
    def is_last_stage(self) -> bool:
        """This rank holds the model's last pipeline stage (outputs and losses appear here)."""
        return self.groups.is_last_stage

    def load_hf(self, hf_tensors: Mapping[str, torch.Tensor]) -> None:
        """Set the weights from full HF-named tensors (the optimizer's copies follow)."""
        load_hf_weights(
            self.chunks,
            self.record,
            hf_tensors,
            self.config,
            tp_rank=self.tp_rank,
            pp_rank=self.pp_rank,
            ep_rank=self.groups.ep_rank,
            etp_rank=self.groups.etp_rank,
        )
        self.optimizer.reload_model_params()

    def gather_params(self) -> None:
        """Make every rank's parameters whole before they are read outside a forward (weight
        sync, export, checkpoint). With ``overlap_param_gather`` the distributed optimizer's
        step updates only this rank's shard and leaves the all-gather to the next forward's
        pre-hooks; this finishes it now (what Megatron-LM's disable_forward_pre_hook does
        before a checkpoint). Collective over the data-parallel group; nothing to do without
        the overlap."""
        if self.gpu.overlap_param_gather:
            for chunk in self.chunks:
                chunk.start_param_sync(force_sync=True)

    def hf_buckets(
        self, bucket_bytes: int, *, buffers: GatherBuffers | None = None, mtp: bool = False
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The whole model's full HF-named tensors on every rank of the replica, in buckets of
        at most ``bucket_bytes`` (``weights/stream.py::stream_policy_weights``): what the weight
        sync loads into the engine and the HF export writes. ``buffers``: a gather pool to keep
        across calls (None: this call's own). ``mtp``: with the MTP layers built in the model,
        their tensors too (the export; the rollout engine loads none). Collective over the TP,
        PP and expert groups."""
        self.gather_params()  # the last update's shards, with overlap_param_gather
        record = dataclasses.replace(self.record, stream_mtp=mtp)
        return stream_policy_weights(
            self.chunks, record, self.config,
            tp_group=self.groups.parallel.tp, pp_group=self.groups.parallel.pp,
            ep_group=self.groups.pg_collection.ep,
            expt_tp_group=self.groups.pg_collection.expt_tp,
            bucket_bytes=bucket_bytes, buffers=buffers,
        )  # fmt: skip

    def export_hf(
        self,
        out_dir: Path,
        *,
        hf_config: dict,
        assets_from: str,
        host_group: dist.ProcessGroup | None,
    ) -> Path:
        """Write the model as an HF directory (``weights/export.py::export_hf``, rank 0 writes)
        from its stream in ``export.BUCKET_BYTES`` buckets. Collective over every rank."""
        return export_hf(
            self.hf_buckets(BUCKET_BYTES, mtp=True), out_dir, hf_config=hf_config,
            head=self.head, dtype=self.config.params_dtype, assets_from=assets_from,
            host_group=host_group, mtp_in_stream=self.record.mtp,
        )  # fmt: skip

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This pipeline stage's weights as full HF-named tensors (collective over TP)."""
        self.gather_params()
        return gather_hf_weights(
            self.chunks,
            self.record,
            self.config,
            tp_group=self.groups.pg_collection.tp,
            pp_rank=self.pp_rank,
            ep_group=self.groups.pg_collection.ep,
            expt_tp_group=self.groups.pg_collection.expt_tp,
        )

    def trainable_state(
        self, *, weights_meta: CheckpointMetadata | None = None, fully_reshardable: bool = False
    ) -> TrainableState:
        """This model's part of a training checkpoint (``checkpoint/state.py``): its chunks,
        optimizer, scheduler and the layout a load compares against."""
        layout = dataclasses.asdict(self.layout)
        layout.update(
            dp=self.groups.dp_size,
            params_dtype=str(self.config.params_dtype),
            distributed_optimizer=self.chunks[0].ddp_config.use_distributed_optimizer,
        )
        return TrainableState(
            chunks=self.chunks,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            layout=layout,
            weights_meta=weights_meta,
            dp_cp_group=self.groups.pg_collection.dp_cp,
            fully_reshardable=fully_reshardable,
        )

    @property
    def vocab_slice(self) -> VocabSlice:
        """This TP rank's slice of the padded vocabulary (for log-probs from its logits)."""
        vocab = self.hf.padded_vocab_size(self.layout.tp)
        return VocabSlice(
            self.groups.pg_collection.tp,
            self.hf.vocab_size,
            self.tp_rank * (vocab // self.layout.tp),
        )

    def run(
        self,
        micro_batches: Sequence[MicroBatch],
        loss_fn: LossFn,
        *,
        forward_only: bool = False,
        record_routes: bool = False, mtp_heads: bool | None = None,
    ) -> list[dict[str, torch.Tensor]]:  # fmt: skip
        """Forward (and backward) over the micro-batches through Megatron's schedule.

        Returns each micro-batch's metrics on the last pipeline stage ([] elsewhere). With
        forward_only, nothing is accumulated; loss_fn's metrics carry the outputs.
        ``record_routes`` (MoE with ``track_routes``): the routers route on their own and
        ``recorded_routes`` keeps each micro-batch's top-k of this rank's routers
        ([router tokens, len(router_replay.layers), top_k] int32 on the device; the router's
        tokens are this CP rank's row, this TP rank's slice under sequence parallelism).
        ``mtp_heads``: loss_fn gets ``models.mtp.MTPOutput`` (None: training with MTP built).
        """
        lengths, sizes = self._check_micro_batches(micro_batches)
        scale = len(micro_batches) * self.dp_size
        if record_routes and self.router_replay is None:
            raise ValueError("record_routes needs an MoE model with track_routes() called")
        recorded: dict[int, torch.Tensor] = {}

        def loss_func(micro_batch: MicroBatch, output: torch.Tensor):
            loss, metrics = loss_fn(output, micro_batch)
            return loss * scale, metrics

        def forward_step(data_iterator, model):
            # The one place a micro-batch leaves the host, right before its forward.
            index, micro_batch = next(data_iterator)
            micro_batch = micro_batch.to(self.device)
            chunk = self.chunks.index(model)
            if record_routes:
                self.router_replay.record(chunk)
            elif self.router_replay is not None:  # this chunk's routers, this micro-batch
                sp = (self.layout.tp, self.tp_rank) if self.layout.sequence_parallel else None
                self.router_replay.set_micro_batch_routes(
                    micro_batch.fields, micro_batch.tokens.numel(), replay=self.replay_routes,
                    chunk=chunk, sequence_parallel=sp,
                )  # fmt: skip
            output = model(
                micro_batch.tokens, micro_batch.position_ids, None,
                packed_seq_params=micro_batch.packed_seq_params,
                **self._mtp_kwargs(mtp_heads, forward_only),
            )  # fmt: skip
            if record_routes:
                self._keep_routes(recorded, index, chunk, micro_batch.tokens.numel())
            return output, partial(loss_func, micro_batch)

        if not forward_only:
            for chunk in self.chunks:
                chunk.zero_grad_buffer()
            # Without the distributed optimizer, param.grad may alias main_grad; clear it.
            self.optimizer.zero_grad()
        for chunk in self.chunks:
            chunk.train(not forward_only)
        pgs = self.groups.pg_collection
        schedule = get_forward_backward_func(pp_size=self.layout.pp, vp_size=self.layout.vpp)
        # The pipelined schedules take p2p from the communicator, the rest from pg_collection.
        p2p = P2PCommunicator(pp_group=pgs.pp, config=self.config) if self.layout.pp > 1 else None
        with torch.set_grad_enabled(not forward_only):
            start = time.perf_counter()
            outputs = schedule(
                forward_step_func=forward_step,
                data_iterator=[iter(enumerate(micro_batches)) for _ in self.chunks],
                model=self.chunks,
                num_microbatches=len(micro_batches),
                seq_length=max(lengths),
                micro_batch_size=sizes.pop(),
                forward_only=forward_only,
                p2p_communicator=p2p,
                pg_collection=pgs,
            )
            self.compute_seconds += time.perf_counter() - start
            if self.router_replay is not None:
                self.router_replay.clear()
            if record_routes:
                self.recorded_routes = [recorded[i] for i in range(len(micro_batches))]
            return outputs

    def _mtp_kwargs(self, mtp_heads: bool | None, forward_only: bool) -> dict[str, bool]:
        """The model's forward keywords for ``run(mtp_heads=)``."""
        if mtp_heads is None:
            mtp_heads = self.record.mtp and not forward_only
        if mtp_heads and not self.record.mtp:
            raise ValueError("mtp_heads needs the MTP layers built (mtp_loss_weight > 0)")
        return {"mtp_heads": True} if mtp_heads else {}

    def _keep_routes(
        self, recorded: dict[int, torch.Tensor], index: int, chunk: int, row_tokens: int
    ) -> None:
        """Micro-batch ``index``'s top-k of chunk ``chunk``'s routers into ``recorded``."""
        replay = self.router_replay
        if index not in recorded:
            tokens = row_tokens // self.layout.tp if self.layout.sequence_parallel else row_tokens
            recorded[index] = torch.full(
                (tokens, len(replay.layers), replay.top_k), -1, dtype=torch.int32,
                device=self.device,
            )  # fmt: skip
        replay.take_recorded(chunk, recorded[index])

    def _check_micro_batches(
        self, micro_batches: Sequence[MicroBatch]
    ) -> tuple[set[int], set[int]]:
        """Refuse micro-batches the schedule cannot take; return their row lengths and batch
        sizes."""
        if not micro_batches:
            raise ValueError("run() needs at least one micro-batch")
        lengths = {mb.seq_length for mb in micro_batches}
        sizes = {mb.tokens.shape[0] for mb in micro_batches}
        if len(sizes) > 1 or (self.layout.pp > 1 and len(lengths) > 1):
            raise ValueError(
                f"micro-batches must share one batch size and, with pp > 1, one length; got "
                f"sizes {sorted(sizes)} and lengths {sorted(lengths)}: pad them to one shape"
            )
        if self.layout.sequence_parallel and any(
            mb.seq_length % (self.layout.tp * self.layout.cp) for mb in micro_batches
        ):
            raise ValueError(
                f"with sequence parallelism every row length must divide by tp * cp = "
                f"{self.layout.tp * self.layout.cp}, got {sorted(lengths)}: pack or pad with "
                f"pad_multiple={self.layout.tp}"
            )
        # On a GPU without Transformer Engine the dense local attention holds [s, s] scores.
        check_local_attention_fits(
            self.record.layer_spec, cp=self.layout.cp, row_tokens=max(lengths)
        )
        return lengths, sizes

    def step(self) -> dict[str, float]:
        """Apply the accumulated gradients: Adam with clipping at the scheduled learning rate.

        Returns grad_norm (before clipping) and lr (the one this update used); the scheduler
        advances first, so the k-th update uses the schedule's value at step k.
        """
        self.scheduler.step(1)
        lr = self.optimizer.param_groups[0]["lr"]  # every group shares one schedule
        start = time.perf_counter()
        updated, grad_norm, _ = self.optimizer.step()
        self.compute_seconds += time.perf_counter() - start
        if not updated:
            raise RuntimeError("the optimizer skipped its step (non-finite gradients)")
        return {
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "lr": float(lr),
        }


def _checked_groups(layout: ModelLayout, groups: ModelGroups | None) -> ModelGroups:
    """``groups`` (None: the layout ``parallel_state`` was initialised with), refused unless
    they have the layout's TP, PP, CP, EP and expert TP sizes."""
    if groups is None:
        groups = ModelGroups.from_parallel_state()
    have = (groups.tp_size, groups.pp_size, groups.cp_size, groups.ep_size, groups.etp_size)
    want = (layout.tp, layout.pp, layout.cp, layout.ep, layout.expert_tp)
    if have != want:
        raise ValueError(
            f"layout tp, pp, cp, ep, etp = {want} but the process groups have {have}: build "
            f"the groups with build_model_groups(tp=, pp=, cp=, ep=, etp=) of this layout"
        )
    return groups


def _check_positions_unused(model: torch.nn.Module) -> None:
    """Packed micro-batches carry no position ids (``MicroBatch.position_ids``): refuse a
    model that would read them (megatron's GPTModel reads them for learned absolute
    position embeddings, multimodal RoPE and multi-token prediction)."""
    kind = getattr(model, "position_embedding_type", "rope")
    # MTPGPTModel hands its MTP block the positions it rolls (RoPE reads none).
    mtp = getattr(model, "mtp_process", False) and not isinstance(model, MTPGPTModel)
    if kind != "rope" or mtp:
        raise ValueError(
            f"the model has position_embedding_type={kind!r}, multi-token prediction {mtp}: "
            "packed micro-batches give no position ids, which only a RoPE model without "
            "multi-token prediction does without (data/packing.py, MicroBatch.position_ids)"
        )


def _build_chunks(
    hf: HFModelConfig,
    config: TransformerConfig,
    gpu: GpuSettings,
    *,
    head: Head,
    layer_spec: ModuleSpec,
    device: torch.device,
    distributed_optimizer: bool,
    pg_collection: ProcessGroupCollection,
) -> list[DistributedDataParallel]:
    """This rank's model chunks (one per virtual pipeline stage) on ``device``, each wrapped in
    megatron's DDP (in Float16Module first with bf16). With overlap_grad_reduce it also sets
    ``config.no_sync_func`` to the chunks' no_sync."""
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer, **gpu.ddp_config_kwargs()
    )
    chunks: list[DistributedDataParallel] = []
    models = build_model(hf, config, head=head, pg_collection=pg_collection, layer_spec=layer_spec)
    for i, model in enumerate(models):
        _check_positions_unused(model)
        # Megatron builds its layers on the GPU already (use_cpu_initialization=False);
        # this moves what it does not own (RoPE buffers, the project's norms and value
        # head) and is a no-op on CPU. Megatron-LM's get_model does the same.
        model.to(device)
        module = Float16Module(config, model) if config.bf16 else model
        chunks.append(
            DistributedDataParallel(
                config, ddp_config, module, disable_bucketing=i > 0, pg_collection=pg_collection
            )
        )
    if gpu.overlap_grad_reduce:
        # The schedule enters no_sync for all but the last micro-batch only through this;
        # without it, a step with another number of micro-batches than the first would
        # reduce buckets early (wrong gradients) or never (megatron's assertion).
        no_sync = [chunk.no_sync for chunk in chunks]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    return chunks


def _build_optimizer(
    optim: OptimSettings,
    chunks: list[DistributedDataParallel],
    gpu: GpuSettings,
    *,
    params_dtype: torch.dtype,
    pg_collection: ProcessGroupCollection,
) -> MegatronOptimizer:
    """Megatron's Adam over the chunks (sharded over data-parallel ranks with
    optim.distributed_optimizer). It sets each group's weight decay to weight_decay *
    megatron's wd_mult, which is 0 for biases and 1-D tensors (norms): only matrices decay."""
    return get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=optim.lr,
            min_lr=optim.min_lr,
            weight_decay=optim.weight_decay,
            adam_beta1=optim.adam_beta1,
            adam_beta2=optim.adam_beta2,
            adam_eps=optim.adam_eps,
            clip_grad=optim.clip_grad,
            bf16=params_dtype == torch.bfloat16,
            params_dtype=params_dtype,
            use_distributed_optimizer=optim.distributed_optimizer,
            overlap_param_gather=gpu.overlap_param_gather,
        ),
        chunks,
        # Megatron's extra gloo DP groups serve only legacy checkpoint formats.
        use_gloo_process_groups=False,
        pg_collection=pg_collection,
    )


def _build_scheduler(optimizer: MegatronOptimizer, optim: OptimSettings) -> OptimizerParamScheduler:
    """The learning rate's warmup and decay (optim.lr_*), weight decay held constant."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_steps,
        # A constant schedule never reads the decay length; megatron wants one past warmup.
        lr_decay_steps=(
            optim.lr_warmup_steps + 1
            if optim.lr_decay_style == "constant"
            else optim.lr_decay_steps
        ),
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
