"""Which prompts each step takes: a seeded permutation per epoch, resumable mid-epoch.

Every rank builds the same sampler from the same seed and sees the same order. Epoch e's
order is drawn from the seed pair (seed, e), so it depends on nothing but those two numbers:
a run resumed from ``state_dict()`` continues with exactly the prompts it would have taken.
(A single integer ``seed + e`` would make run seed=1's epoch 0 equal run seed=0's epoch 1.)
"""

from __future__ import annotations

import numpy as np


class PromptSampler:
    """Endless stream of prompt indices in [0, num_prompts), epoch after epoch."""

    def __init__(self, num_prompts: int, *, seed: int, shuffle: bool = True) -> None:
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be at least 1, got {num_prompts}")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.num_prompts = num_prompts
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        """Epochs completed."""
        self.position = 0
        """Indices of the current epoch already handed out."""
        self._order = self._epoch_order(0)

    def next_indices(self, n: int) -> list[int]:
        """The next ``n`` indices; crossing an epoch's end continues into the next permutation."""
        if n < 0:
            raise ValueError(f"n must be non-negative, got {n}")
        indices: list[int] = []
        while len(indices) < n:
            take = min(n - len(indices), self.num_prompts - self.position)
            indices.extend(self._order[self.position : self.position + take].tolist())
            self.position += take
            if self.position == self.num_prompts:
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
        return indices

    def state_dict(self) -> dict[str, int | bool]:
        """Where the stream is, plus what it was built with (checked on load)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_prompts": self.num_prompts,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, int | bool]) -> None:
        """Continues from ``state``; the dataset size, seed and shuffle must be the same."""
        for key in ("num_prompts", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this sampler has "
                    f"{getattr(self, key)!r}: resume with the same dataset and seed, or start "
                    "the sampler afresh"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.num_prompts:
            raise ValueError(
                f"sampler state epoch={epoch}, position={position} is out of range for "
                f"{self.num_prompts} prompts"
            )
        self.epoch, self.position = epoch, position
        self._order = self._epoch_order(epoch)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_prompts)
        return np.random.default_rng((self.seed, epoch)).permutation(self.num_prompts)
