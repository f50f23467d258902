"""The weight sync's producer thread (rollout/prefetch.py): order, bound, errors, clean exits."""

import threading
import time

import pytest
import torch

from vapo_megatron.rollout.prefetch import Prefetcher

pytestmark = pytest.mark.unit


def producer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "vapo-prefetch"]


def test_order_is_preserved():
    with Prefetcher(iter(range(100))) as items:
        assert list(items) == list(range(100))
    assert producer_threads() == []


def test_empty_source():
    with Prefetcher(iter([])) as items:
        assert list(items) == []


def test_items_are_produced_in_the_producer_thread():
    def source():
        for _ in range(3):
            yield threading.current_thread().name

    with Prefetcher(source()) as items:
        assert list(items) == ["vapo-prefetch"] * 3


def test_producer_stays_one_item_ahead():
    pulled = []

    def source():
        for i in range(6):
            pulled.append(i)
            yield i

    with Prefetcher(source(), ahead=1) as items:
        time.sleep(0.05)
        assert pulled == [0]  # nothing beyond the first item before the consumer takes it
        for i in items:
            time.sleep(0.05)  # the producer has had time to run ahead as far as allowed
            assert max(pulled) <= i + 1, (i, pulled)
    assert pulled == list(range(6))


def test_exception_in_the_producer_reaches_the_consumer_after_earlier_items():
    def source():
        yield 1
        yield 2
        raise ValueError("gather failed")

    got = []
    with pytest.raises(ValueError, match="gather failed"), Prefetcher(source()) as items:
        for item in items:
            got.append(item)
    assert got == [1, 2]
    assert producer_threads() == []


def test_early_close_stops_the_producer_and_closes_the_source():
    closed = threading.Event()
    pulled = []

    def source():
        try:
            for i in range(1000):
                pulled.append(i)
                yield i
        finally:
            closed.set()

    with Prefetcher(source()) as items:
        assert next(items) == 0
        assert next(items) == 1
    assert closed.is_set()
    assert producer_threads() == []
    assert max(pulled) <= 2  # stopped after the item it was allowed to produce


def test_exception_in_the_consumer_joins_the_thread():
    def source():
        yield from range(10)

    with pytest.raises(RuntimeError, match="load failed"), Prefetcher(source()) as items:
        for item in items:
            if item == 3:
                raise RuntimeError("load failed")
    assert producer_threads() == []


def test_close_while_the_producer_is_slow():
    def source():
        yield 0
        time.sleep(0.2)  # still producing item 1 when the consumer closes
        yield 1
        yield 2

    start = time.perf_counter()
    with Prefetcher(source()) as items:
        assert next(items) == 0
    assert producer_threads() == []
    assert time.perf_counter() - start < 5


def test_wait_seconds_counts_time_waiting_for_the_producer():
    def source():
        for i in range(3):
            time.sleep(0.05)
            yield i

    with Prefetcher(source()) as items:
        list(items)
    assert items.wait_seconds >= 0.1


def test_caller_grad_mode_is_kept():
    def source():
        yield torch.is_grad_enabled()

    with torch.no_grad(), Prefetcher(source()) as items:
        assert list(items) == [False]


def test_bad_ahead():
    with pytest.raises(ValueError, match="ahead"):
        Prefetcher(iter([]), ahead=0)
