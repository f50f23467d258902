"""What the parts share: the device and dtype, the model and step, and what earlier parts
built (groups, engines, outputs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from gpu_checks.frame import Results
from gpu_checks.tiny import HF_CONFIG, OPTIM, StepData, random_step
from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.algorithms.presets import algo_preset
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.models.provider import local_spec
from vapo_megatron.parallel.model_groups import ModelGroups


@dataclass
class Context:
    device: torch.device
    dtype: torch.dtype
    workdir: Path
    twin: bool
    """--cpu: collectives read every group but the host group as NCCL (``twin.py``)."""
    te: tuple[bool, str]
    """(whether transformer_engine imports, its version or the error)."""
    transformers: tuple[bool, str]
    results: Results
    vllm: tuple[bool, str] = (False, "not looked for")
    """(whether vLLM is installed, its version or why not); found, not imported (``vllm_routes``
    imports it in its own ranks)."""
    gpus: int = 0
    """CUDA devices visible (0 with --cpu): parts that launch 2 ranks need 2."""
    hf: HFModelConfig = field(default_factory=lambda: HFModelConfig.from_hf(HF_CONFIG))
    algo: AlgoConfig = field(default_factory=lambda: algo_preset("vapo"))
    step: StepData | None = None
    # Filled by the parts:
    host: dist.ProcessGroup | None = None
    """The job's gloo group (``collectives.make_host_group``): objects and host bookkeeping."""
    policy_groups: ModelGroups | None = None
    critic_groups: ModelGroups | None = None
    policy: ModelEngine | None = None
    critic: ModelEngine | None = None
    """The plain engines (local spec, the project's defaults): the world-1 flat path."""
    policy_tensors: dict[str, torch.Tensor] | None = None
    """The policy's HF tensors as read from the HF directory."""
    old_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    """[N] the scoring part's outputs (initial weights), in flat order."""
    update_metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    """The plain engines' first update ("critic", "policy"), to hold the 32B path's against."""
    hf_model: torch.nn.Module | None = None
    shard_policy: ModelEngine | None = None
    shard_critic: ModelEngine | None = None
    """The 32B recipe's engines (distributed optimizer, overlaps, recompute)."""
    shard_steps_done: int = 0

    def __post_init__(self) -> None:
        if self.step is None:
            self.step = random_step(self.hf.vocab_size)

    @property
    def hf_dir(self) -> Path:
        return self.workdir / "hf_policy"

    def engine(self, head: str, groups: ModelGroups, layer_spec=None, **kwargs) -> ModelEngine:
        """A policy ("lm") or critic ("value") engine of the tiny model, weights not loaded;
        ``kwargs`` go to ``ModelEngine`` (optim, gpu, recompute)."""
        kwargs.setdefault("optim", OPTIM)
        return ModelEngine(
            self.hf, ModelLayout(), head=head, groups=groups, params_dtype=self.dtype,
            layer_spec=layer_spec or local_spec(), **kwargs,
        )  # fmt: skip
