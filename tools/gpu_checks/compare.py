"""What a model's training state is (weights, optimizer main parameters, Adam moments), and
bit-for-bit comparisons of it."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from gpu_checks.frame import check
from vapo_megatron.engine.model_engine import ModelEngine


def live_state(engine: ModelEngine) -> Iterator[tuple[str, torch.Tensor]]:
    """Everything a resume or an offload round trip must give back, as the tensors
    themselves, keyed by where they sit: chunk state (weights, buffers), then each inner
    optimizer's parameters (main parameters) and their state (Adam moments). Gradients are
    not in it (the next update rewrites them)."""
    for i, chunk in enumerate(engine.chunks):
        for key, value in chunk.state_dict(keep_vars=True).items():
            if isinstance(value, torch.Tensor):
                yield f"chunk{i}.{key}", value
    opts = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
    for o, opt in enumerate(opts):
        inner = opt.optimizer
        params = [p for group in inner.param_groups for p in group["params"]]
        for j, param in enumerate(params):
            yield f"opt{o}.param{j}", param
            for key, value in inner.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    yield f"opt{o}.param{j}.{key}", value


def tensors_of(engine: ModelEngine) -> dict[str, torch.Tensor]:
    """A copy of :func:`live_state` (scheduler state is compared apart)."""
    return {key: value.detach().clone() for key, value in live_state(engine)}


def resident_bytes(engines: list[ModelEngine], device: torch.device) -> int:
    """Bytes of the distinct storages on ``device`` that the engines' state lives in."""
    seen: dict[int, int] = {}
    for engine in engines:
        for _, tensor in live_state(engine):
            storage = tensor.untyped_storage()
            if tensor.device == device and storage.nbytes():
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def compare_exact(
    saved: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor], what: str
) -> tuple[int, float]:
    """(tensors compared, max |diff|); CheckFailed unless the names and every value agree."""
    check(sorted(saved) == sorted(loaded), f"{what}: names differ: {set(saved) ^ set(loaded)}")
    worst = 0.0
    differ = []
    for key, value in saved.items():
        other = loaded[key]
        if value.shape != other.shape or value.dtype != other.dtype:
            differ.append(f"{key} {tuple(value.shape)}/{value.dtype} vs {tuple(other.shape)}")
            continue
        if not torch.equal(value, other.to(value.device)):
            diff = (value.double() - other.to(value.device).double()).abs().max().item()
            worst = max(worst, diff)
            differ.append(f"{key} ({diff:.3g})")
    check(not differ, f"{what}: {len(differ)} of {len(saved)} differ: {differ[:5]}")
    return len(saved), worst


def param_snapshot(engine: ModelEngine) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in engine.chunks for p in chunk.parameters()]


def max_change(before: list[torch.Tensor], engine: ModelEngine) -> float:
    after = [p.detach() for chunk in engine.chunks for p in chunk.parameters()]
    pairs = zip(after, before, strict=True)
    return max((a.double() - b.double()).abs().max().item() for a, b in pairs)
