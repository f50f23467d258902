"""Where the random generators stand on this rank (python, numpy, torch CPU and CUDA, and
Megatron's model-parallel tracker), saved with each checkpoint and restored at the same layout."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.random.get_cuda_rng_tracker()
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "megatron_tracker": host_copy(tracker.get_states()),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["cuda"])
    tensor_parallel.random.get_cuda_rng_tracker().set_states(state["megatron_tracker"])


def host_copy(tree: Any) -> Any:
    """``tree`` with every tensor copied to the CPU (a view would save its whole buffer)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {key: host_copy(value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(host_copy(value) for value in tree)
    return tree
