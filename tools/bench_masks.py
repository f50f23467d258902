"""How long torch counts a step-sized boolean mask on the host (``algorithms/masks.py``).

    python tools/bench_masks.py

One thread, 10.8M entries (a quarter of the 32B step's response tokens on one rank), best of
five; each row also as a ratio to ``count_nonzero`` measured in the same run.
"""

from __future__ import annotations

import torch
from bench_gae import best_of

TOKENS = 10_800_000


def main() -> None:
    torch.set_num_threads(1)
    mask = torch.zeros(TOKENS, dtype=torch.bool)
    mask[::3] = True
    expanded = torch.ones(1, dtype=torch.bool).expand(TOKENS)
    rows = {
        "count_nonzero(mask)": lambda: int(torch.count_nonzero(mask)),
        "mask.sum()": lambda: int(mask.sum()),
        "mask.all()": lambda: bool(mask.all()),
        "mask.any()": lambda: bool(mask.any()),
        "count_nonzero(expanded)": lambda: int(torch.count_nonzero(expanded)),
        "expanded.all()": lambda: bool(expanded.all()),
    }
    times = {name: best_of(fn, (), repeats=5) * 1e3 for name, fn in rows.items()}
    reference = times["count_nonzero(mask)"]
    print(f"{'':<26} {'ms':>8} {'x count_nonzero':>16}")
    for name, ms in times.items():
        print(f"{name:<26} {ms:8.2f} {ms / reference:16.1f}")


if __name__ == "__main__":
    main()
