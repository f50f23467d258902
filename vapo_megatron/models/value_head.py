"""The critic's value head: hidden -> one fp32 scalar per token, replacing the LM output layer."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region


class ValueHead(torch.nn.Module):
    """Linear(hidden, 1) without bias, replicated on every tensor-parallel rank.

    Takes the place of ``GPTModel.output_layer`` and keeps its call signature
    ``(hidden, weight=None, runtime_gather_output=None) -> (output, bias)``.

    hidden: [s, b, h], or [s / tp, b, h] with sequence parallelism; returns values [s, b, 1]
    in fp32. Under sequence parallelism the full sequence is gathered first, so every TP rank
    computes the same values and the same weight gradient (no TP all-reduce is needed); the
    gather's backward only slices the gradient, since no rank holds a partial sum.

    ``tp_group`` is the model's own TP group (``pg_collection.tp``), used only for the
    sequence-parallel gather.

    The weight starts at zero (V = 0 everywhere): identical on every rank without coordinating
    random streams; value pretraining, or a reward model's head, gives it its values. It is
    made on ``device``, where megatron makes the model's other parameters
    (``parallel.devices.init_device``): without the distributed optimizer nothing else would
    move it to the GPU.
    """

    def __init__(
        self,
        hidden_size: int,
        *,
        sequence_parallel: bool,
        tp_group: dist.ProcessGroup | None,
        device: torch.device,
    ):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, device=device))
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        if weight is not None:
            raise ValueError("a critic's value head never shares the embedding weight")
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return F.linear(hidden.float(), self.weight.float()), None
