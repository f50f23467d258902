"""One trained model (policy or critic): DDP-wrapped chunks, optimizer and pipeline schedule.

Loss scaling. Loss functions return this micro-batch's *share of the global loss* (sums divided
by global counts, see ``parallel/reductions.py``), so the gradient we want is the plain sum of
the shares' gradients over micro-batches and data x context ranks. Megatron instead averages:
with a 2-tuple loss the schedule multiplies by cp_size and divides by the number of
micro-batches, and DDP scales gradients by 1 / (dp * cp). The engine multiplies each share by
num_microbatches * dp_size before handing it to Megatron, which cancels both exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.spec_utils import ModuleSpec

from vapo_megatron.data.packing import MicroBatch
from vapo_megatron.models.config import Head, HFModelConfig
from vapo_megatron.models.hf_weights import gather_hf_weights, load_hf_weights
from vapo_megatron.models.logprobs import VocabSlice
from vapo_megatron.models.provider import ModelLayout, build_model, transformer_config
from vapo_megatron.models.record import ModelRecord

LossFn = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""(model output [b, s, V/tp] logits or [b, s, 1] values, micro-batch) -> (loss share, metrics)."""


@dataclass(frozen=True, kw_only=True)
class OptimSettings:
    """Adam settings of one model."""

    lr: float = 1e-6
    """Learning rate (VAPO: 1e-6 policy, 2e-6 critic)."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.95
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0: no clipping)."""
    distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""


class ModelEngine:
    """This rank's chunks of one model, wrapped for training, with their optimizer."""

    def __init__(
        self,
        hf: HFModelConfig,
        layout: ModelLayout,
        *,
        head: Head,
        optim: OptimSettings,
        params_dtype: torch.dtype = torch.float32,
        layer_spec: ModuleSpec | None = None,
    ):
        layout.check(hf)
        self.hf, self.layout, self.head = hf, layout, head
        self.record = ModelRecord(hf, head)
        self.config = transformer_config(hf, layout, params_dtype=params_dtype)
        self.config.finalize_model_grads_func = finalize_model_grads
        bf16 = params_dtype == torch.bfloat16
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=optim.distributed_optimizer, grad_reduce_in_fp32=bf16
        )
        self.chunks: list[DistributedDataParallel] = []
        for i, model in enumerate(build_model(hf, self.config, head=head, layer_spec=layer_spec)):
            module = Float16Module(self.config, model) if bf16 else model
            self.chunks.append(
                DistributedDataParallel(self.config, ddp_config, module, disable_bucketing=i > 0)
            )
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=optim.lr,
                weight_decay=optim.weight_decay,
                adam_beta1=optim.adam_beta1,
                adam_beta2=optim.adam_beta2,
                adam_eps=optim.adam_eps,
                clip_grad=optim.clip_grad,
                bf16=bf16,
                params_dtype=params_dtype,
                use_distributed_optimizer=optim.distributed_optimizer,
            ),
            self.chunks,
        )

    def load_hf(self, hf_tensors: Mapping[str, torch.Tensor]) -> None:
        """Set the weights from full HF-named tensors (the optimizer's copies follow)."""
        load_hf_weights(
            self.chunks,
            self.record,
            hf_tensors,
            self.config,
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        )
        self.optimizer.reload_model_params()

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This pipeline stage's weights as full HF-named tensors (collective over TP)."""
        return gather_hf_weights(
            self.chunks,
            self.record,
            self.config,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        )

    @property
    def vocab_slice(self) -> VocabSlice:
        """This TP rank's slice of the padded vocabulary (for log-probs from its logits)."""
        vocab = self.hf.padded_vocab_size(self.layout.tp)
        return VocabSlice(
            parallel_state.get_tensor_model_parallel_group(),
            self.hf.vocab_size,
            parallel_state.get_tensor_model_parallel_rank() * (vocab // self.layout.tp),
        )

    def run(
        self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, *, forward_only: bool = False
    ) -> list[dict[str, torch.Tensor]]:
        """Forward (and backward) over the micro-batches through Megatron's schedule.

        Returns each micro-batch's metrics on the last pipeline stage ([] elsewhere). With
        forward_only, nothing is accumulated; loss_fn's metrics carry the outputs.
        """
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
        scale = len(micro_batches) * parallel_state.get_data_parallel_world_size()

        def loss_func(micro_batch: MicroBatch, output: torch.Tensor):
            loss, metrics = loss_fn(output, micro_batch)
            return loss * scale, metrics

        def forward_step(data_iterator, model):
            micro_batch = next(data_iterator)
            output = model(
                micro_batch.tokens,
                micro_batch.position_ids,
                None,
                packed_seq_params=micro_batch.packed_seq_params,
            )
            return output, partial(loss_func, micro_batch)

        if not forward_only:
            for chunk in self.chunks:
                chunk.zero_grad_buffer()
            # Without the distributed optimizer, param.grad may alias main_grad; clear it.
            self.optimizer.zero_grad()
        for chunk in self.chunks:
            chunk.train(not forward_only)
        with torch.set_grad_enabled(not forward_only):
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=[iter(micro_batches) for _ in self.chunks],
                model=self.chunks,
                num_microbatches=len(micro_batches),
                seq_length=max(lengths),
                micro_batch_size=sizes.pop(),
                forward_only=forward_only,
            )

    def step(self) -> dict[str, float]:
        """Apply the accumulated gradients: Adam with clipping. Returns grad_norm."""
        updated, grad_norm, _ = self.optimizer.step()
        if not updated:
            raise RuntimeError("the optimizer skipped its step (non-finite gradients)")
        return {"grad_norm": float(grad_norm) if grad_norm is not None else float("nan")}
