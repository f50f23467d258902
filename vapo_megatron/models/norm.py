"""RMSNorm for megatron-core's local layer spec, usable with sequence parallelism.

megatron-core's torch fallback (``WrappedTorchNorm``) refuses sequence parallelism. This norm
tags its weight ``sequence_parallel`` when the config asks for it, so that
``finalize_model_grads`` all-reduces the weight's gradient over the TP group (each TP rank saw
only its slice of the sequence). Numerics follow HF's Qwen2/Llama RMSNorm: normalise in fp32,
cast back to the input dtype, then scale. It never communicates, so it needs no process group:
the all-reduce is ``finalize_model_grads``' over the TP group of the model's ``pg_collection``.
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig

from vapo_megatron.parallel.devices import init_device


class RMSNorm(torch.nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), over the last dim; x: [..., hidden]."""

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ):
        super().__init__()
        if (
            config.normalization != "RMSNorm"
            or zero_centered_gamma
            or config.layernorm_zero_centered_gamma
        ):
            raise ValueError(
                f"this norm is RMSNorm with a plain gain; got normalization={config.normalization!r}, "
                f"zero_centered_gamma={zero_centered_gamma or config.layernorm_zero_centered_gamma}"
            )
        self.weight = torch.nn.Parameter(
            torch.ones(
                hidden_size,
                dtype=config.params_dtype,
                device=init_device(config.use_cpu_initialization),
            )
        )
        self.weight.sequence_parallel = config.sequence_parallel
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)
