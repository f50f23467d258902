"""Tensors a vLLM model holds as plain module attributes, which vLLM's level-2 sleep discards
and nothing restores: found, saved on host before the sleep and copied back after the weights
wake, by worker RPCs (``RolloutEngine.sleep``/``wake_up``)."""

from __future__ import annotations

import torch

from vapo_megatron.parallel.devices import HOST


def unsaved_module_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Tensors on the model's device held as plain attributes of its modules: neither
    parameters (the sync rewrites those) nor registered buffers (vLLM's level-2 sleep saves and
    restores those: rotary ``cos_sin_cache``, attention ``_k_scale`` ...), nor the KV cache each
    attention layer holds as ``kv_cache`` (its own pool, which wakes empty by design). vLLM
    allocates such tensors in its weights pool while building the model, so level 2 discards
    them and nothing else brings them back; rotary caches kept outside ``register_buffer`` were
    the known case (vLLM #16564, NeMo-RL #2631). vLLM 0.32's Qwen2 holds none on the device
    (``tests/integration/rollout/test_offload_vllm_tensors.py`` lists what its model holds)."""
    out: dict[str, torch.Tensor] = {}
    device = next(model.parameters()).device
    for module_name, module in model.named_modules():
        registered = {id(t) for t in (*module._parameters.values(), *module._buffers.values())}
        for name, value in vars(module).items():
            if (
                isinstance(value, torch.Tensor)
                and not isinstance(value, torch.nn.Parameter)
                and value.device == device
                and id(value) not in registered
                and name != "kv_cache"
            ):
                out[f"{module_name}.{name}" if module_name else name] = value
    return out


def save_unsaved_module_tensors(worker) -> int:
    """vLLM worker RPC, before a level-2 sleep: host copies of ``unsaved_module_tensors``."""
    tensors = unsaved_module_tensors(worker.model_runner.model)
    worker.vapo_unsaved_tensors = {name: t.to(HOST, copy=True) for name, t in tensors.items()}
    return len(tensors)


def restore_unsaved_module_tensors(worker) -> int:
    """vLLM worker RPC, after waking the weights from level 2: copy the saved tensors back."""
    saved = getattr(worker, "vapo_unsaved_tensors", {})
    tensors = unsaved_module_tensors(worker.model_runner.model)
    for name, host in saved.items():
        tensors[name].copy_(host)
    worker.vapo_unsaved_tensors = {}
    return len(saved)
