"""The bundle of process groups that code below the trainer receives.

The trainer gets one per model (``ModelGroups.parallel`` from ``model_groups.py``, or from
megatron-core's ``parallel_state`` when one layout serves the job, or by hand in tests) and
passes it down; nothing under ``algorithms/``, ``parallel/``, ``models/`` or ``rollout/`` calls
a global group getter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class ParallelGroups:
    """Process groups of one rank. ``None`` means a group of size 1 (this rank alone)."""

    tp: dist.ProcessGroup | None = None
    """Tensor-parallel group."""
    pp: dist.ProcessGroup | None = None
    """Pipeline-parallel group."""
    cp: dist.ProcessGroup | None = None
    """Context-parallel group."""
    dp: dist.ProcessGroup | None = None
    """Data-parallel group (without context parallelism)."""
    dp_cp: dist.ProcessGroup | None = None
    """Data x context parallel group: where token counts and gradients are reduced."""

    @staticmethod
    def size(group: dist.ProcessGroup | None) -> int:
        return 1 if group is None else dist.get_world_size(group)

    @staticmethod
    def rank(group: dist.ProcessGroup | None) -> int:
        return 0 if group is None else dist.get_rank(group)

    @classmethod
    def from_parallel_state(cls) -> ParallelGroups:
        """Read the groups megatron-core's ``parallel_state`` initialised (trainer only)."""
        from megatron.core import parallel_state as ps

        return cls(
            tp=ps.get_tensor_model_parallel_group(),
            pp=ps.get_pipeline_model_parallel_group(),
            cp=ps.get_context_parallel_group(),
            dp=ps.get_data_parallel_group(),
            dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
        )
