"""The trainer side of the separate placement: batches come from the rollout ranks, weights
go to them, over the bridge groups (``parallel/placement.py``).

The protocol. Trainer rank 0 sends the rollout ranks orders (int64 [ORDER], the ``orders``
group); each order's reply, if any, comes back on the ``samples`` group from rollout rank 0
(``trainer/rollout_ranks.py`` serves them). Each group's operations therefore run in the
same order on both sides, whatever either side does in between.

| order | reply | the rollout ranks |
|---|---|---|
| START(step, queued, sampler JSON) | | resume the schedule: batches up to step + queued exist |
| WEIGHTS(version) + buckets | | load the policy's weights (``weights/bridge_stream.py``) |
| STEP(s, queued) | batch s, unless queued | send batch s (made now if not yet) unless a flush already sent it, then make every batch the schedule allows with these weights (up to s + lag) |
| PRETRAIN(seed step, index) | the batch | one critic-pretraining batch (frozen policy) |
| FLUSH | count, batches | send the batches made and not yet sent (a checkpoint keeps them) |
| EVAL(step) | metrics JSON | evaluate with the weights they hold |
| STOP | | shut down |

The schedule is ``step/rollout_queue.py``'s: batch t is made with the weights of version
t - 1 - lag (or 0). After STEP(s) the rollout ranks hold version s - 1 and make batches up to
s + lag while the trainers train step s: that is the overlap. The trainers wait in STEP for a
batch not yet made; the rollout ranks wait for the next order once they have made all the
schedule allows.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence

import torch

from vapo_megatron.data.sampler import PromptSampler
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.parallel.placement import Bridge, bridge_broadcast
from vapo_megatron.step.rollout import RolloutStats
from vapo_megatron.step.rollout_queue import QueuedBatch, RolloutQueue
from vapo_megatron.step.trajectories import Trajectories
from vapo_megatron.step.trajectory_wire import recv_batch
from vapo_megatron.weights.bridge_stream import send_buckets

ORDER = 4
START, WEIGHTS, STEP, PRETRAIN, FLUSH, EVAL, STOP = range(7)
ORDER_NAMES = ("START", "WEIGHTS", "STEP", "PRETRAIN", "FLUSH", "EVAL", "STOP")


def send_order(bridge: Bridge, op: int, a: int = 0, b: int = 0, text: bytes = b"") -> None:
    """Trainer rank 0: one order (and its JSON text, where it has one) to the rollout ranks."""
    order = torch.tensor([op, a, b, len(text)], dtype=torch.long, device=HOST)
    bridge_broadcast(order, bridge.orders, HOST)
    if text:
        bridge_broadcast(torch.frombuffer(bytearray(text), dtype=torch.uint8), bridge.orders, HOST)


def recv_order(bridge: Bridge) -> tuple[int, int, int, bytes]:
    """A rollout rank: the next order (op, a, b, text)."""
    order = torch.empty(ORDER, dtype=torch.long, device=HOST)
    bridge_broadcast(order, bridge.orders, HOST)
    op, a, b, size = order.tolist()
    text = b""
    if size:
        payload = torch.empty(size, dtype=torch.uint8, device=HOST)
        bridge_broadcast(payload, bridge.orders, HOST)
        text = payload.numpy().tobytes()
    return op, a, b, text


def send_text(bridge: Bridge, text: bytes) -> None:
    """Rollout rank 0: a JSON reply to the trainer ranks (length first)."""
    size = torch.tensor([len(text)], dtype=torch.long, device=HOST)
    bridge_broadcast(size, bridge.samples, HOST)
    if text:
        bridge_broadcast(torch.frombuffer(bytearray(text), dtype=torch.uint8), bridge.samples, HOST)


def recv_text(bridge: Bridge) -> bytes:
    size = torch.empty(1, dtype=torch.long, device=HOST)
    bridge_broadcast(size, bridge.samples, HOST)
    if not int(size):
        return b""
    payload = torch.empty(int(size), dtype=torch.uint8, device=HOST)
    bridge_broadcast(payload, bridge.samples, HOST)
    return payload.numpy().tobytes()


class RemoteRollouts:
    """The trainer ranks' end of the bridge: a step's batch (``take``), the policy's weights
    after an update (``publish``), the batches in flight for a checkpoint (``flush``, kept in
    ``queue``, whose state the checkpoint saves), evaluation on the rollout ranks."""

    def __init__(
        self, bridge: Bridge, lag: int, *, is_sender: bool, sampler: PromptSampler
    ) -> None:
        self.bridge, self.lag = bridge, lag
        self.is_sender = is_sender
        """Trainer rank 0: sends the orders and the weights."""
        self.queue = RolloutQueue(lag)
        """Batches received ahead of their step (a flush for a checkpoint)."""
        self.sampler = sampler
        """Mirrors the rollout ranks' sampler: its position after the last batch received
        (what a checkpoint saves, and START gives back)."""

    def start(self, step: int, sampler_state: dict, buckets: Iterable[Sequence]) -> None:
        """Tell the rollout ranks where the run is (after ``step`` steps, with ``queue``'s
        batches already here) and give them the policy's weights (``buckets``: every trainer
        rank iterates the stream, trainer rank 0 sends it)."""
        if self.is_sender:
            text = json.dumps(sampler_state).encode()
            send_order(self.bridge, START, step, len(self.queue.batches), text)
        self.publish(step, buckets)

    def publish(self, version: int, buckets: Iterable[Sequence]) -> dict[str, float]:
        """The policy's weights after ``version`` updates to the rollout ranks (every trainer
        rank runs the stream's collectives; trainer rank 0 sends)."""
        started = time.perf_counter()
        if not self.is_sender:
            for _ in buckets:  # the stream's collectives, in step with the sender
                pass
            return {}
        send_order(self.bridge, WEIGHTS, version)
        count, num_bytes = send_buckets(buckets, self.bridge.weights, self.bridge.weights_device)
        return {
            "sync/gb": num_bytes / 1e9, "sync/buckets": float(count),
            "time/publish": time.perf_counter() - started,
        }  # fmt: skip

    def take(self, step: int) -> tuple[Trajectories, RolloutStats]:
        """Step ``step``'s batch: from ``queue`` where a flush brought it, else sent for. The
        order goes either way: it tells the rollout ranks when to make the next batches."""
        started = time.perf_counter()
        queued = bool(self.queue.batches)
        if self.is_sender:
            send_order(self.bridge, STEP, step, int(queued))
        info: dict = {}
        if queued:
            batch = self.queue.batches.popleft()
        else:
            batch, info = recv_batch(self.bridge.samples)
            self.sampler.load_state_dict(info["sampler"])
        if batch.step != step:
            raise RuntimeError(f"step {step} got step {batch.step}'s batch from the rollout ranks")
        trajectories, stats = self._stats(batch, info, time.perf_counter() - started)
        stats.extra["staleness"] = float(step - 1 - batch.version)
        return trajectories, stats

    def take_pretrain(self, seed_step: int, index: int) -> tuple[Trajectories, RolloutStats]:
        """Critic-pretraining batch ``index`` (seeds of ``seed_step``), made now by the frozen
        policy."""
        started = time.perf_counter()
        if self.is_sender:
            send_order(self.bridge, PRETRAIN, seed_step, index)
        batch, info = recv_batch(self.bridge.samples)
        self.sampler.load_state_dict(info["sampler"])
        return self._stats(batch, info, time.perf_counter() - started)

    def flush(self) -> int:
        """Bring the batches the rollout ranks made ahead (a checkpoint saves them); returns
        how many came."""
        if self.is_sender:
            send_order(self.bridge, FLUSH)
        count = int(recv_text(self.bridge) or b"0")
        for _ in range(count):
            batch, info = recv_batch(self.bridge.samples)
            self.queue.batches.append(batch)
            self.sampler.load_state_dict(info["sampler"])
        return count

    def evaluate(self, step: int) -> dict[str, float]:
        """The rollout ranks' evaluation with the weights they hold (the latest published)."""
        if self.is_sender:
            send_order(self.bridge, EVAL, step)
        return json.loads(recv_text(self.bridge))

    def stop(self) -> None:
        if self.is_sender:
            send_order(self.bridge, STOP)

    @staticmethod
    def _stats(batch: QueuedBatch, info: dict, waited: float) -> tuple[Trajectories, RolloutStats]:
        stats = batch.stats
        stats.extra = {
            **stats.extra, "time/trainer_wait": waited,
            "time/rollout_wait": float(info.get("rollout_wait_s", 0.0)),
        }  # fmt: skip
        # The trainers' step spent ``waited`` in the rollout phase, none of it generating here.
        stats.generate_seconds, stats.reward_seconds = waited, 0.0
        return batch.trajectories, stats
