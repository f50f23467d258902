"""GAE benchmark: the chunked scan against the textbook reverse loop, one thread.

Then the 32B recipe's step shape (8,192 samples, lognormal response lengths capped at 20,480,
about 42M tokens): decoupled packed GAE (both lambdas, no padding) against a memcpy of the
bytes it reads and writes (fp32 rewards and values in, advantages and returns out), and with
truncated importance traces (V-trace with lambda: per-token ratios pi_old / mu, both rows
scanned) against without, in the same run.
Also prints what context-parallel GAE sends per sequence (a carry per chunk) against
gathering the sequence's values, rewards and mask on every rank.
"""

from __future__ import annotations

import json
import time

import torch

from vapo_megatron.algorithms.advantages import decoupled_gae_packed
from vapo_megatron.algorithms.gae import gae_padded
from vapo_megatron.algorithms.presets import algo_preset
from vapo_megatron.parallel.cp_gae import CARRY_FIELDS


def textbook_gae(rewards, values, mask, lam, gamma):
    """The reverse loop over time steps (vectorised over the batch only), skipping masked tokens."""
    batch, length = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(batch)
    running = torch.zeros(batch)
    for t in reversed(range(length)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * running
        running = torch.where(m, gae_t, running)
        next_value = torch.where(m, values[:, t], next_value)
        advantages[:, t] = gae_t * m
    return advantages


def make_batch(batch: int, length: int, seed: int = 0):
    """Prompt, then response, then padding in every row; reward 1 or 0 on the last token."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(batch, length, generator=gen)
    prompt = torch.randint(0, length // 8, (batch,), generator=gen)
    response = torch.randint(length // 4, length - length // 8, (batch,), generator=gen)
    pos = torch.arange(length)[None, :]
    mask = (pos >= prompt[:, None]) & (pos < (prompt + response)[:, None])
    rewards = torch.zeros(batch, length)
    rewards[torch.arange(batch), prompt + response - 1] = torch.randint(
        0, 2, (batch,), generator=gen
    ).float()
    lam = torch.rand(batch, generator=gen)
    return rewards, values, mask, lam


# The 32B recipe's step (recipes/vapo.yaml): 512 prompts x 16 samples, max_new_tokens 20,480;
# response lengths lognormal around a ~5,200-token mean (the measured shape).
STEP_SAMPLES = 8192
MAX_RESPONSE = 20480
LOG_MEDIAN, LOG_SIGMA = 8.27, 0.8


def response_lengths(samples: int, seed: int = 0) -> torch.Tensor:
    """[S] int64 response lengths of the recipe's distribution, capped at MAX_RESPONSE."""
    gen = torch.Generator().manual_seed(seed)
    draw = torch.exp(torch.randn(samples, generator=gen) * LOG_SIGMA + LOG_MEDIAN)
    return draw.clamp(1, MAX_RESPONSE).long()


def step_shape_packed(samples: int):
    """Flat rewards (score at each response's last token), values, mask, cu_seqlens."""
    lengths = response_lengths(samples)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    num_tokens = int(cu[-1])
    rewards = torch.zeros(num_tokens)
    rewards[cu[1:] - 1] = torch.randint(0, 2, (samples,)).float()
    values = torch.rand(num_tokens)
    return rewards, values, torch.ones(num_tokens, dtype=torch.bool), cu


def best_of(fn, args, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times)


def run(quick: bool = False) -> None:
    torch.set_num_threads(1)
    shapes = [(64, 1024), (8, 4096)] if quick else [(512, 4096), (64, 32768)]
    print(f"{'B x T':>12} {'loop s':>9} {'scan ms':>9} {'speedup':>8} {'max |diff|':>11}")
    speedup = 0.0
    for batch, length in shapes:
        rewards, values, mask, lam = make_batch(batch, length)
        args = (rewards, values, mask, lam, 1.0)
        reference = textbook_gae(*args)
        loop_s = best_of(textbook_gae, args, 2)
        fast, _ = gae_padded(*args)
        scan_s = best_of(gae_padded, args, 7)
        speedup = loop_s / scan_s
        diff = (fast - reference).abs().max().item()
        print(
            f"{batch:>5} x {length:<6} {loop_s:9.3f} {scan_s * 1e3:9.2f} {speedup:8.1f} {diff:11.2e}"
        )

    samples = 512 if quick else STEP_SAMPLES
    packed = step_shape_packed(samples)
    num_tokens = packed[0].numel()
    cfg = algo_preset("vapo")
    gae_s = best_of(lambda *a: decoupled_gae_packed(cfg, *a), packed, 3)
    src = torch.empty(2 * num_tokens)  # 8 bytes per token read, 8 written: the GAE's own I/O
    dst = torch.empty_like(src)
    memcpy_s = best_of(dst.copy_, (src,), 3)
    print(f"\n32B step shape: {samples} samples, {num_tokens:,} response tokens")
    print(f"{'packed GAE s':>13} {'memcpy s':>9} {'ratio':>6}")
    print(f"{gae_s:13.3f} {memcpy_s:9.3f} {gae_s / memcpy_s:6.1f}")
    # Ratios of a policy a few versions old: log-ratio ~ N(0, 0.3^2), some past the bars of 1.
    gen = torch.Generator().manual_seed(1)
    ratios = torch.exp(0.3 * torch.randn(num_tokens, generator=gen))
    traced_s = best_of(lambda *a: decoupled_gae_packed(cfg, *a, ratios=ratios), packed, 3)
    print(f"{'with traces s':>13} {'ratio':>6}")
    print(f"{traced_s:13.3f} {traced_s / gae_s:6.2f}")

    length = shapes[-1][1]
    gathered = length * (4 + 4 + 1)  # fp32 values and rewards, bool mask, per rank
    print(f"\ncontext-parallel GAE, bytes one sequence of {length} tokens sends per rank:")
    print(f"{'CP':>4} {'carries':>9} {'gather seq':>11}")
    for cp in (2, 4, 8):
        carries = 2 * len(CARRY_FIELDS) * 4  # two chunks per rank, fp32 fields
        print(f"{cp:>4} {carries:>9} {gathered * (cp - 1) // cp:>11}")
    print(
        json.dumps(
            {
                "bench": "gae",
                "shape": list(shapes[-1]),
                "speedup_vs_loop": round(speedup, 1),
                "step_samples": samples,
                "step_tokens": num_tokens,
                "step_gae_s": round(gae_s, 3),
                "step_memcpy_s": round(memcpy_s, 3),
                "step_gae_traces_s": round(traced_s, 3),
            }
        )
    )
