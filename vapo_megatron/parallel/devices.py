"""Where tensors live: the host for bookkeeping, the training device for everything the model
or a collective of a model's group touches (``docs/design.md``, "Devices")."""

from __future__ import annotations

import torch

HOST = torch.device("cpu")
"""Bookkeeping: the step's samples, flat per-token buffers, counts, packing."""


def training_device() -> torch.device:
    """This rank's GPU (``torch.cuda.set_device(LOCAL_RANK)`` picked it), or the host on CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return HOST


def init_device(use_cpu_initialization: bool) -> torch.device:
    """Where megatron-core creates a model's parameters under ``use_cpu_initialization``
    (its layers follow the same rule), so the project's own modules start there too."""
    return HOST if use_cpu_initialization else training_device()
