"""Chunked vocab-parallel log-probs: the same numbers for every chunk size, bounded memory."""

import ctypes
import ctypes.util

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vapo_megatron.models.logprobs import vocab_parallel_logprobs

pytestmark = pytest.mark.unit


def _logprobs_and_grad(logits, labels, vocab_size, chunk_tokens, temperature=0.7):
    x = logits.clone().requires_grad_()
    logp, ent = vocab_parallel_logprobs(
        x, labels, tp_group=None, vocab_size=vocab_size, temperature=temperature,
        chunk_tokens=chunk_tokens,
    )  # fmt: skip
    weights = torch.linspace(-1, 1, logp.numel(), dtype=logp.dtype).view(logp.shape)
    (logp * weights + 0.3 * ent * weights.flip(-1)).sum().backward()
    return logp.detach(), ent.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_chunk_size_gives_the_same_bits(dtype):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 7, 50, generator=gen).to(dtype)  # [B, T, V_local]
    labels = torch.randint(0, 45, (3, 7), generator=gen)
    whole = _logprobs_and_grad(logits, labels, 45, chunk_tokens=21)
    assert whole[2].dtype == dtype and torch.all(whole[2][..., 45:] == 0)
    for chunk_tokens in (1, 4, 20, 1000):
        got = _logprobs_and_grad(logits, labels, 45, chunk_tokens)
        for a, b in zip(got, whole, strict=True):
            assert torch.equal(a, b), chunk_tokens
    ref = torch.log_softmax(logits[..., :45].double() / 0.7, -1)
    torch.testing.assert_close(
        whole[0].double(), ref.gather(-1, labels[..., None]).squeeze(-1), atol=1e-5, rtol=1e-5
    )


def test_non_contiguous_logits_and_bad_chunk():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 2, 30, generator=gen).transpose(0, 1)  # [B, T, V] from [T, B, V]
    labels = torch.randint(0, 30, (2, 9), generator=gen)
    got = _logprobs_and_grad(logits, labels, 30, chunk_tokens=4)
    want = _logprobs_and_grad(logits.contiguous(), labels, 30, chunk_tokens=18)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1, got 0"):
        vocab_parallel_logprobs(logits, labels, tp_group=None, vocab_size=30, chunk_tokens=0)


class _PeakHostMemory(TorchDispatchMode):
    """Peak of glibc's allocated bytes, sampled after every aten op (forward and backward)."""

    class _Mallinfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
            "keepcost".split()
        ]

    def __init__(self):
        super().__init__()
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        if not hasattr(libc, "mallinfo2"):
            pytest.skip("peak memory needs glibc >= 2.33 (mallinfo2); not measured here")
        libc.mallinfo2.restype = self._Mallinfo2
        self._mallinfo2 = libc.mallinfo2

    def _used(self) -> int:
        info = self._mallinfo2()
        return info.uordblks + info.hblkhd

    def __enter__(self):
        self.base, self.peak = self._used(), 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self._used() - self.base)
        return out


def _peak_bytes(logits, labels, vocab_size, chunk_tokens) -> int:
    x = logits.clone().requires_grad_()
    with _PeakHostMemory() as meter:
        logp, ent = vocab_parallel_logprobs(
            x, labels, tp_group=None, vocab_size=vocab_size, chunk_tokens=chunk_tokens
        )
        (logp.sum() + 0.1 * ent.sum()).backward()
    return meter.peak


def test_chunked_peak_memory():
    """Peak above the bf16 logits = their gradient + a few fp32 temporaries of one chunk.

    The single-chunk peak is ~9x the logits (the unchunked code before this change measured
    12.8x, ~25.6 bytes per element: it also saved the fp32 shifted logits for backward).
    """
    num_tokens, vocab = 4096, 2048
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(num_tokens, vocab, generator=gen).to(torch.bfloat16)  # 16 MiB
    labels = torch.randint(0, vocab - 64, (num_tokens,), generator=gen)
    grad_bytes = logits.numel() * logits.element_size()
    peaks = {c: _peak_bytes(logits, labels, vocab - 64, c) for c in (num_tokens, 1024, 256)}
    print(  # pytest -s shows the measurement (docs/scaling.md quotes it)
        f"logits {grad_bytes / 2**20:.0f} MiB bf16; peak above them by chunk_tokens: "
        + ", ".join(f"{c}: {p / 2**20:.1f} MiB" for c, p in peaks.items())
    )
    for chunk_tokens, peak in peaks.items():
        chunk_fp32 = chunk_tokens * vocab * 4
        assert peak <= grad_bytes + 5 * chunk_fp32 + 2**20, (chunk_tokens, peak)
    assert peaks[256] < 3.5 * grad_bytes < peaks[num_tokens], peaks
