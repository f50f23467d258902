"""GAE benchmark: the chunked scan against the textbook reverse loop, one thread.

Also prints what context-parallel GAE sends per sequence (a carry per chunk) against
gathering the sequence's values, rewards and mask on every rank.
"""

from __future__ import annotations

import json
import time

import torch

from vapo_megatron.algorithms.gae import gae_padded
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

    length = shapes[-1][1]
    gathered = length * (4 + 4 + 1)  # fp32 values and rewards, bool mask, per rank
    print(f"\ncontext-parallel GAE, bytes one sequence of {length} tokens sends per rank:")
    print(f"{'CP':>4} {'carries':>9} {'gather seq':>11}")
    for cp in (2, 4, 8):
        carries = 2 * len(CARRY_FIELDS) * 4  # two chunks per rank, fp32 fields
        print(f"{cp:>4} {carries:>9} {gathered * (cp - 1) // cp:>11}")
    print(
        json.dumps(
            {"bench": "gae", "shape": list(shapes[-1]), "speedup_vs_loop": round(speedup, 1)}
        )
    )
