"""Where tensors live: the host for bookkeeping, the training device for everything the model
or a collective of a model's group touches (``docs/design.md``, "Devices")."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

HOST = torch.device("cpu")
"""Bookkeeping: the step's samples, flat per-token buffers, counts, packing."""


_stand_in: torch.device | None = None
"""Set by :func:`building_on` (the dry run's meta device); None in a real run."""


def training_device() -> torch.device:
    """This rank's GPU (``torch.cuda.set_device(LOCAL_RANK)`` picked it), or the host on CPU."""
    if _stand_in is not None:
        return _stand_in
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return HOST


def init_device(use_cpu_initialization: bool) -> torch.device:
    """Where megatron-core creates a model's parameters under ``use_cpu_initialization``
    (its layers follow the same rule), so the project's own modules start there too."""
    if _stand_in is not None:
        return _stand_in
    return HOST if use_cpu_initialization else training_device()


@contextmanager
def building_on(device: torch.device) -> Iterator[None]:
    """Within: the training and init devices are ``device``. The dry run
    (``planning/dry_run.py``) builds models on ``meta`` this way: shapes and dtypes as in the
    real run, no memory."""
    global _stand_in
    before, _stand_in = _stand_in, device
    try:
        yield
    finally:
        _stand_in = before
