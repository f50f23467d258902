"""GPU settings resolve from CUDA and the installed kernels; CPU keeps megatron-core's defaults."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch
from megatron.core.distributed import DistributedDataParallelConfig

from vapo_megatron.config import gpu as gpu_settings
from vapo_megatron.config.gpu import GpuSettings, ResolvedGpuSettings, resolve
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.recipe import load_recipe
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.models.provider import transformer_config

pytestmark = pytest.mark.unit
RECIPES = Path(__file__).resolve().parents[3] / "recipes"
FUSIONS = list(gpu_settings.FUSION_KERNELS)
TE, APEX_WGRAD = "transformer_engine", "fused_weight_gradient_mlp_cuda"
APEX_SOFTMAX, TRITON = "scaled_upper_triang_masked_softmax_cuda", "triton"


def installed(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Only ``modules`` (of the kernels' modules) are importable; CUDA is available."""
    real = importlib.util.find_spec
    kernels = {module for module, _ in gpu_settings.FUSION_KERNELS.values()}

    def find_spec(name, *args, **kwargs):
        if name in kernels:
            return object() if name in modules else None
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def qwen2() -> HFModelConfig:
    return HFModelConfig.from_hf(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 64,
            "max_position_embeddings": 64,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1e6,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
        }
    )


def fields(config) -> dict[str, str]:
    """Every field's repr (the init functions are fresh partials: equal, not identical)."""
    return {f.name: repr(getattr(config, f.name)) for f in dataclasses.fields(config)}


def on(resolved: ResolvedGpuSettings) -> set[str]:
    return {k for k, v in dataclasses.asdict(resolved).items() if v}


def test_cpu_resolves_to_todays_values() -> None:
    for bf16 in (False, True):
        resolved = resolve(GpuSettings(), bf16=bf16, distributed_optimizer=True, cuda=False)
        assert on(resolved) == ({"grad_reduce_in_fp32"} if bf16 else set())
        # Exactly the DDP config the engine built before these settings existed.
        assert DistributedDataParallelConfig(
            use_distributed_optimizer=True, **resolved.ddp_config_kwargs()
        ) == DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=bf16)
        hf, layout = qwen2(), ModelLayout(tp=1)
        dtype = torch.bfloat16 if bf16 else torch.float32
        assert fields(transformer_config(hf, layout, params_dtype=dtype, gpu=resolved)) == (
            fields(transformer_config(hf, layout, params_dtype=dtype))
        )


def test_cpu_is_the_default_here() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    resolved = resolve(GpuSettings(), bf16=False, distributed_optimizer=False)
    assert resolved == ResolvedGpuSettings()


def test_cuda_with_te_apex_and_triton_turns_every_fusion_on(monkeypatch) -> None:
    installed(monkeypatch, TE, APEX_WGRAD, APEX_SOFTMAX, TRITON)
    resolved = resolve(GpuSettings(), bf16=True, distributed_optimizer=True)
    # The overlaps need a caller that wires megatron's sync hooks (ModelEngine does).
    assert on(resolved) == {*FUSIONS, "grad_reduce_in_fp32"}
    with_hooks = resolve(GpuSettings(), bf16=True, distributed_optimizer=True, overlap_hooks=True)
    assert with_hooks.overlap_grad_reduce and with_hooks.overlap_param_gather
    plain_adam = resolve(GpuSettings(), bf16=True, distributed_optimizer=False, overlap_hooks=True)
    assert plain_adam.overlap_grad_reduce and not plain_adam.overlap_param_gather


def test_cuda_without_te_or_apex_keeps_what_torch_can_do(monkeypatch) -> None:
    installed(monkeypatch, TRITON)
    resolved = resolve(GpuSettings(), bf16=True, distributed_optimizer=True)
    assert on(resolved) == {"bias_activation_fusion", "grad_reduce_in_fp32"}
    installed(monkeypatch, TE, TRITON)  # TE without apex: no wgrad fusion (GPTModel's output
    resolved = resolve(GpuSettings(), bf16=True, distributed_optimizer=True)  # layer is megatron's)
    assert on(resolved) == {
        "bias_activation_fusion", "apply_rope_fusion", "grad_reduce_in_fp32",
        "moe_grouped_gemm", "moe_permute_fusion",  # TE's; dense models drop them
    }  # fmt: skip


def test_false_wins_over_an_installed_kernel(monkeypatch) -> None:
    installed(monkeypatch, TE, APEX_WGRAD, APEX_SOFTMAX, TRITON)
    off = GpuSettings(**{name: False for name in FUSIONS}, grad_reduce_in_fp32=False)
    assert on(resolve(off, bf16=True, distributed_optimizer=True)) == set()


@pytest.mark.parametrize(
    ("field", "package"),
    [
        ("apply_rope_fusion", "transformer-engine"),
        ("gradient_accumulation_fusion", "fused_weight_gradient_mlp_cuda"),
        ("masked_softmax_fusion", "apex"),
        ("bias_activation_fusion", "triton"),
    ],
)
def test_explicit_true_without_its_kernel_names_the_package(monkeypatch, field, package) -> None:
    installed(monkeypatch)
    with pytest.raises(ValueError, match=f"gpu.{field}=true needs .*{package}"):
        resolve(GpuSettings(**{field: True}), bf16=True, distributed_optimizer=True)
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve(GpuSettings(**{field: True}), bf16=True, distributed_optimizer=True, cuda=False)


def test_overlaps_refused_where_they_would_be_wrong() -> None:
    with pytest.raises(ValueError, match="no_sync_func"):
        resolve(GpuSettings(overlap_grad_reduce=True), bf16=True, distributed_optimizer=True)
    hooks = dict(bf16=True, overlap_hooks=True, cuda=True)
    with pytest.raises(ValueError, match="policy.optim.distributed_optimizer=true"):
        resolve(
            GpuSettings(overlap_grad_reduce=True, overlap_param_gather=True),
            distributed_optimizer=False,
            name="policy",
            **hooks,
        )
    with pytest.raises(ValueError, match="overlap_grad_reduce=False"):
        resolve(
            GpuSettings(overlap_grad_reduce=False, overlap_param_gather=True),
            distributed_optimizer=True,
            **hooks,
        )


def test_values_other_than_auto_true_false_are_refused() -> None:
    with pytest.raises(ValueError, match="must be auto, true or false"):
        GpuSettings(apply_rope_fusion="yes")


def test_resolved_fusions_land_in_the_configs() -> None:
    hf, layout = qwen2(), ModelLayout(tp=1)
    fused = ResolvedGpuSettings(
        bias_activation_fusion=True,
        masked_softmax_fusion=True,
        gradient_accumulation_fusion=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        grad_reduce_in_fp32=True,
    )
    config = transformer_config(hf, layout, params_dtype=torch.bfloat16, gpu=fused)
    assert config.bias_activation_fusion and config.masked_softmax_fusion
    assert config.gradient_accumulation_fusion and not config.apply_rope_fusion
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, **fused.ddp_config_kwargs())
    assert ddp.overlap_grad_reduce and ddp.overlap_param_gather and ddp.grad_reduce_in_fp32
    # megatron-core validates the RoPE fusion itself: without Transformer Engine it refuses it.
    if importlib.util.find_spec(TE) is None:
        with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
            transformer_config(hf, layout, gpu=ResolvedGpuSettings(apply_rope_fusion=True))


def test_recipes_state_the_settings() -> None:
    config = load_recipe(RECIPES / "vapo_qwen2.5_32b.yaml")
    assert config.gpu == GpuSettings(
        bias_activation_fusion=True,
        apply_rope_fusion=True,
        masked_softmax_fusion="auto",
        gradient_accumulation_fusion=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        grad_reduce_in_fp32=True,
    )
    assert load_recipe(RECIPES / "tiny_cpu.yaml").gpu == GpuSettings()
    with pytest.raises(ValueError, match="gpu.apply_rope_fusion"):
        load_recipe(RECIPES / "tiny_cpu.yaml", ["gpu.apply_rope_fusion=maybe"])
