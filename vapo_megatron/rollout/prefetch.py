"""Run an iterator one item ahead in a producer thread: the weight stream's collectives and
conversions for bucket k+1 overlap the engine's load of bucket k.

The producer thread is the only one that advances the source iterator, so the source's
collectives happen in the source's own order on every rank, exactly as if it were consumed in
the caller (the caller must not run collectives on the same groups meanwhile). The producer
pulls item k+1 only once the consumer has taken item k: at most ``ahead`` items exist beyond
the one being consumed. An exception raised by the source is re-raised in the consumer (once,
after the items produced before it); closing early (``close``, the ``with`` block's end, or
an exception in the consumer) stops the producer after the item it is producing, closes the
source in the producer thread and joins the thread. A producer blocked in a collective whose
peers never come stays blocked until the collective's own timeout, as a caller would.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

import torch

T = TypeVar("T")

_ITEM, _END, _ERROR = "item", "end", "error"


class Prefetcher(Generic[T]):
    """Iterate over ``items`` with a producer thread ``ahead`` items ahead of the consumer.

    Use as ``with Prefetcher(items) as it: for x in it: ...``; the thread is joined when the
    block ends, however it ends. ``wait_seconds`` accumulates the time the consumer spent
    waiting for the producer.

    ``switch_interval``: while the producer runs, the interpreter's thread switch interval
    (``sys.setswitchinterval``, process-wide; restored on close). The producer mostly waits
    in collectives and torch kernels with the GIL released; each time one returns it needs the
    GIL back from a consumer running Python (vLLM's loaders), which by default keeps it up to
    5 ms, and the wait delays the collective's peers too. None leaves the interval alone.
    """

    def __init__(
        self,
        items: Iterable[T],
        *,
        ahead: int = 1,
        name: str = "vapo-prefetch",
        switch_interval: float | None = 2e-4,
    ):
        if ahead < 1:
            raise ValueError(f"ahead must be >= 1, got {ahead}")
        self._saved_interval = None
        if switch_interval is not None:
            self._saved_interval = sys.getswitchinterval()
            sys.setswitchinterval(switch_interval)
        self._source = iter(items)
        self._queue: queue.Queue = queue.Queue(maxsize=ahead)
        self._permits = threading.Semaphore(ahead)
        self._stop = threading.Event()
        self._done = False
        self.wait_seconds = 0.0
        self._thread = threading.Thread(
            target=self._produce, args=(_caller_state(),), name=name, daemon=True
        )
        self._thread.start()

    def _produce(self, state: dict) -> None:
        """Producer thread: one item per permit, then the end marker or the exception."""
        try:
            _enter_caller_state(state)
            while True:
                self._permits.acquire()
                if self._stop.is_set():
                    return
                try:
                    item = next(self._source)
                except StopIteration:
                    self._queue.put((_END, None))
                    return
                self._queue.put((_ITEM, item))
                del item  # the consumer's reference alone keeps it alive
        except BaseException as err:  # every failure must reach the consumer
            self._queue.put((_ERROR, err))
        finally:
            close = getattr(self._source, "close", None)
            if close is not None:
                close()  # a generator source runs its cleanup here, in the producer thread

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        start = time.perf_counter()
        kind, value = self._queue.get()
        self.wait_seconds += time.perf_counter() - start
        if kind == _ITEM:
            self._permits.release()  # the producer may start the next item now
            return value
        self._done = True
        self._thread.join()
        if kind == _ERROR:
            raise value
        raise StopIteration

    def close(self) -> None:
        """Stop the producer after its current item, drop what it produced, join it."""
        self._done = True
        self._stop.set()
        self._permits.release()  # wakes a producer waiting for a permit
        while self._thread.is_alive():
            self._drain()  # a producer blocked on a full queue can put and finish
            self._thread.join(timeout=0.05)
        self._drain()
        if self._saved_interval is not None:
            sys.setswitchinterval(self._saved_interval)
            self._saved_interval = None

    def _drain(self) -> None:
        """Drop every item waiting in the queue."""
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _caller_state() -> dict:
    """Thread-local torch state of the caller that the producer must run under."""
    state = {"grad_enabled": torch.is_grad_enabled()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_device"] = torch.cuda.current_device()
    return state


def _enter_caller_state(state: dict) -> None:
    """Apply ``_caller_state`` in this (the producer) thread."""
    torch.set_grad_enabled(state["grad_enabled"])
    if "cuda_device" in state:
        torch.cuda.set_device(state["cuda_device"])
