"""Every part of the check, in run order."""

from __future__ import annotations

from gpu_checks.checkpoint_parts import checkpoint, checkpoint_weights
from gpu_checks.interop_parts import hf_logits, te_spec, weight_stream
from gpu_checks.moe_part import moe
from gpu_checks.offload_part import offload
from gpu_checks.recipe32b_parts import shard_engines, shard_steps
from gpu_checks.step_parts import (
    default_layer_spec_part,
    distributed,
    engines,
    scoring,
    update_critic,
    update_policy,
)

PARTS = {
    "distributed": distributed,
    "default_layer_spec": default_layer_spec_part,
    "engines": engines,
    "scoring": scoring,
    "update_critic": update_critic,
    "update_policy": update_policy,
    "weight_stream": weight_stream,
    "hf_logits": hf_logits,
    "checkpoint": checkpoint,
    "checkpoint_weights": checkpoint_weights,
    "te_spec": te_spec,
    "shard_engines": shard_engines,
    "shard_steps": shard_steps,
    "offload": offload,
    "moe": moe,
}
"""Name -> part(ctx, numbers), in run order."""
OPTIONAL_PARTS = {"te_spec", "hf_logits"}
"""Parts whose 'skipped' (their reason: a package not importable, or --cpu) still lets ok be
true."""
