"""The optimizer-state repairs a checkpoint needs around megatron-core 0.16: a fresh optimizer
given the state its first step would make (so its save writes moments a load can find), and a
distributed optimizer's load that keeps torch's Adam one ``step`` per parameter."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.optimizer import ChainedOptimizer, DistributedOptimizer, MegatronOptimizer

from vapo_megatron.parallel.devices import HOST


def sub_optimizers(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    """The optimizers a megatron optimizer is made of (a ``ChainedOptimizer``'s, or itself)."""
    if isinstance(optimizer, ChainedOptimizer):
        return list(optimizer.chained_optimizers)
    return [optimizer]


def fill_fresh_optimizer_state(opt: MegatronOptimizer) -> None:
    """Give every parameter that has no optimizer state yet the state a first step would make:
    megatron's ``init_state_fn`` (Adam's zero moments, or Transformer Engine's own
    ``initialize_state`` with the precision-aware optimizer) and, for torch's Adam, a zero
    per-parameter ``step``.

    An optimizer that has not stepped holds no state: a policy frozen through critic
    pretraining, and any model under TE's ``FusedAdam``, which makes its state lazily at the
    first ``step()``. A save would then write no moments (the distributed optimizer writes only
    ``param``) while every load lays them out and asks for them, so such a checkpoint could not
    be loaded. The zero state is what the first step would have made: training is unchanged.
    TE's and Apex's Adam keep their step count in the parameter groups, not per parameter."""
    if opt.init_state_fn is not None:
        opt.init_state_fn(opt.optimizer, opt.config)
    if not _uses_torch_adam(opt):
        return
    for group in opt.optimizer.param_groups:
        for param in group["params"]:
            state = opt.optimizer.state[param]
            if "step" not in state:  # torch's Adam makes a host float32 zero at its first step
                state["step"] = torch.zeros((), dtype=torch.float32, device=HOST)


def load_optimizer(opt: MegatronOptimizer, loaded: dict[str, Any]) -> None:
    """``opt.load_state_dict(loaded)``, around two megatron-core 0.16 bugs of the distributed
    optimizer with torch's Adam: its ``load_state_dict`` gives every parameter one shared
    ``step`` tensor (torch's Adam then increments it once per parameter: wrong bias correction),
    and its parameter-state loaders copy into every state key, ``step`` included, which the
    fully reshardable format does not hold (KeyError) and the DP-reshardable one holds as this
    rank's stale pre-load value. So: the parameter-free part first, then the parameter state
    with ``step`` set aside, then one ``step`` per parameter."""
    if not isinstance(opt, DistributedOptimizer):
        # FP32Optimizer's state is torch's; the mixed-precision ones nest it under "optimizer".
        inner = loaded["optimizer"]["state"] if "optimizer" in loaded else loaded["state"]
        if _uses_torch_adam(opt) and inner and "common_step" not in inner:
            # megatron saves the common step only when it is nonzero (a state saved before the
            # first update), and torch's Adam refuses moments without a step.
            inner["common_step"] = torch.zeros((), dtype=torch.float32, device=HOST)
        opt.load_state_dict(loaded)  # one deep copy of the common step per parameter
        return
    param_state = loaded.pop("param_state")
    fmt = loaded.pop("param_state_sharding_type")
    opt.load_state_dict(loaded)
    inner = opt.optimizer.state
    steps = {param: entry.pop("step") for param, entry in inner.items() if "step" in entry}
    with torch.no_grad():  # copies into the fp32 main params, which are leaves with grad
        if fmt == "dp_reshardable":
            for entry in _nested_dicts_with(param_state, "padding"):
                entry.pop("step", None)
            opt.load_parameter_state_from_dp_reshardable(param_state)
        elif fmt == "fully_reshardable":
            opt.load_parameter_state_from_fully_reshardable(param_state)
        else:
            raise ValueError(f"unknown distributed optimizer format {fmt!r} in the checkpoint")
    for param, step in steps.items():
        inner[param]["step"] = step.detach().clone()
    if steps:  # torch's Adam counts in its state; megatron's copy in the groups would go stale
        for group in opt.optimizer.param_groups:
            group.pop("step", None)


def _uses_torch_adam(opt: MegatronOptimizer) -> bool:
    return isinstance(opt.optimizer, torch.optim.Adam | torch.optim.AdamW)


def _nested_dicts_with(tree: Any, key: str) -> list[dict[str, Any]]:
    if isinstance(tree, dict):
        found = [tree] if key in tree else []
        return found + [d for value in tree.values() for d in _nested_dicts_with(value, key)]
    if isinstance(tree, list | tuple):
        return [d for value in tree for d in _nested_dicts_with(value, key)]
    return []
