"""What a step takes of the run: a small named context, built by the training session
(``trainer/session.py``) and the evaluation session (``trainer/evaluation.py``) alike, so
``step/`` never imports the run that holds it.

One owner for the engine's staleness: ``weights_current`` says whether the rollout engine holds
the policy's current weights; the step clears it once the policy has moved and sets it after a
sync, evaluation sets it after its own sync, and a resume clears it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.distributed as dist

    from vapo_megatron.config.train import TrainConfig
    from vapo_megatron.data.prompts import TokenizedPrompt
    from vapo_megatron.data.sampler import PromptSampler
    from vapo_megatron.engine.model_engine import ModelEngine
    from vapo_megatron.rollout.engine import RolloutEngine
    from vapo_megatron.step.remote_rollouts import RemoteRollouts
    from vapo_megatron.step.rollout_queue import RolloutQueue


@dataclass(kw_only=True, eq=False)
class StepContext:
    """The models, engines, groups, data and sampler a step (or an evaluation) uses."""

    config: TrainConfig
    rollout: RolloutEngine
    """This rank's vLLM engine replica member (``rollout/engine.py``)."""
    tokenizer: Any
    """The policy's tokenizer (decodes responses for the graders)."""
    stop_token_ids: list[int]
    routing: Mapping[str, Any]
    """data_source -> grader (``rewards/registry.py::resolve_routing``)."""
    host_group: dist.ProcessGroup | None
    """Gloo over every rank: counts, timings, trajectories, the advantage exchange."""
    rank: int
    replica: int
    """This rank's engine replica (ranks r*k .. r*k + k-1 form replica r, k = rollout TP)."""
    num_replicas: int
    policy: ModelEngine | None = None
    """None where nothing trains (``vapo-eval``)."""
    critic: ModelEngine | None = None
    sampler: PromptSampler | None = None
    """Draws each step's prompts (seeded, resumable); None where nothing trains."""
    train_prompts: Sequence[TokenizedPrompt] = ()
    run_dir: Path | None = None
    """Where critic pretraining saves its rollouts (``critic_pretrain.save_rollouts``)."""
    data_path: str | None = None
    """The path of the last step's per-token outputs ("shards"/"routed"), logged when it
    changes (``step/run.py::output_route``)."""
    weights_current: bool = False
    """Whether the engine holds the policy's current weights."""
    engine_sleeps: bool = True
    """The engine sleeps after each generation (colocated: training takes the device); the
    separate placement's rollout ranks keep it awake."""
    remote: RemoteRollouts | None = None
    """The separate placement's trainer ranks: batches from the rollout ranks, weights to
    them (``step/remote_rollouts.py``); ``rollout`` is None then."""
    rollout_queue: RolloutQueue | None = None
    """Batches generated ahead (``rollout.lag`` > 0, ``step/rollout_queue.py``); None: each
    step generates its own."""

    @property
    def rollout_synced(self) -> bool:
        """Whether the engine holds the policy's current weights *and* is awake to use them. A
        sleeping engine reads as not synced, so the next rollout goes through ``sync_weights``,
        which wakes it in the right order (the engine refuses to generate while asleep)."""
        if self.rollout is None:  # the separate placement's trainers hold no engine
            return self.weights_current
        return self.weights_current and not self.rollout.state.asleep
