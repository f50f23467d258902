"""Every part of the check, in run order."""

from __future__ import annotations

from gpu_checks.checkpoint_parts import checkpoint, checkpoint_weights
from gpu_checks.interop_parts import hf_logits, te_spec, weight_stream
from gpu_checks.moe_ep_part import moe_ep
from gpu_checks.moe_part import moe
from gpu_checks.moe_te_part import moe_te
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
from gpu_checks.vllm_routes_part import vllm_routes

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
    "moe_te": moe_te,
    "moe_ep": moe_ep,
    "vllm_routes": vllm_routes,
}
"""Name -> part(ctx, numbers), in run order. Which skips fail the check: ``verdict.py``."""
