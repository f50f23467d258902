"""Graders by name, data_source -> grader routing, and batch scoring with a per-response timeout.

A grader is ``fn(response: str, ground_truth: str) -> GradeResult``, registered under a name
with the verdict it gives a wrong response. A row's ``data_source`` picks the grader through
the routing (``DEFAULT_ROUTING`` plus the recipe's ``reward.routing``); check the routing with
``check_data_sources`` when the data is loaded, so that a missing entry fails at start.

Timeouts. Graders run on one daemon worker thread while the calling thread waits on each
response with a deadline, so this works in any thread of a process that also runs
torch.distributed and vLLM (no signals, which only the main thread gets, and no fork of a
process holding CUDA). A grader past its deadline is abandoned, not killed: its thread runs on
until the grader returns, then exits, and a fresh worker takes the remaining responses. Being
a daemon it does not hold up process exit. A grader stuck in C code that keeps the GIL (a
pathological ``re`` match) also stalls the waiting thread, so the deadline then fires late.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from vapo_megatron.rewards import GradeResult, dapo_math, long_trace

logger = logging.getLogger(__name__)

Grader = Callable[[str, str], GradeResult]
"""fn(response_text, ground_truth) -> GradeResult."""


@dataclass(frozen=True, kw_only=True)
class _Entry:
    fn: Grader
    wrong: GradeResult


_GRADERS: dict[str, _Entry] = {}

DEFAULT_ROUTING: Mapping[str, str] = {
    "math_dapo": "dapo_math",
    "math_dapo_reasoning": "dapo_math",
    "math": "dapo_math",
    "aime": "dapo_math",
    "aime24": "dapo_math",
    "aime25": "dapo_math",
    "aime2024": "dapo_math",
    "aime2025": "dapo_math",
    "long_trace": "long_trace",
}
"""data_source -> grader name. verl sends these (and any name starting with 'aime') to DAPO's grader."""


@dataclass(kw_only=True)
class ScoringStats:
    """What one score_responses call did."""

    num_responses: int = 0
    """Responses scored."""
    num_errors: int = 0
    """Responses whose grader raised (or returned something other than a GradeResult); scored wrong."""
    num_timeouts: int = 0
    """Responses whose grader ran past timeout_s; scored wrong."""
    first_error: str | None = None
    """The first grader failure, as 'data_source: ExceptionType: message' (for the log)."""
    seconds: float = 0.0
    """Wall time of the call."""


def register_grader(
    name: str,
    fn: Grader,
    *,
    wrong: GradeResult = dapo_math.WRONG,
    replace: bool = False,
) -> None:
    """Makes ``fn`` available as ``name``; ``wrong`` is what a failed or timed-out call scores."""
    if not name:
        raise ValueError("grader name must be a non-empty string")
    if name in _GRADERS and not replace:
        raise ValueError(f"grader {name!r} is already registered; pass replace=True to replace it")
    _GRADERS[name] = _Entry(fn=fn, wrong=wrong)


def get_grader(name: str) -> Grader:
    """The grader registered as ``name``."""
    return _entry(name).fn


def registered_graders() -> list[str]:
    """Names of all registered graders."""
    return sorted(_GRADERS)


def resolve_routing(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """DEFAULT_ROUTING with ``overrides`` (the recipe's reward.routing) on top."""
    return {**DEFAULT_ROUTING, **(overrides or {})}


def check_data_sources(sources: set[str], routing: Mapping[str, str]) -> None:
    """Raises ValueError, at start, for a data_source with no route or a route to no grader."""
    unknown = sorted(s for s in sources if s not in routing)
    if unknown:
        raise ValueError(
            f"data_source {unknown} has no grader; routed data sources: {sorted(routing)}. Add "
            f"a mapping to the recipe's reward.routing, e.g. reward.routing: {{{unknown[0]!r}: "
            f"'dapo_math'}} (graders: {registered_graders()})"
        )
    missing = sorted({routing[s] for s in sources} - set(_GRADERS))
    if missing:
        raise ValueError(
            f"reward.routing names grader(s) {missing} that are not registered; registered: "
            f"{registered_graders()} (register others with register_grader)"
        )


def score_responses(
    items: Sequence[tuple[str, str, str]],
    routing: Mapping[str, str],
    *,
    timeout_s: float,
) -> tuple[list[GradeResult], ScoringStats]:
    """Grades (data_source, response_text, ground_truth) items, in order.

    A grader that raises or runs past ``timeout_s`` gives its declared wrong verdict and is
    counted in the stats; the call itself returns normally (see the module doc).
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    check_data_sources({source for source, _, _ in items}, routing)
    if not items:
        return [], ScoringStats()
    start = time.monotonic()
    entries = [_entry(routing[source]) for source, _, _ in items]
    stats = ScoringStats(num_responses=len(items))
    results: list[GradeResult] = []
    box = _Mailbox(len(items))
    worker = _start_worker(items, entries, box, first=0)
    for i, (source, _, _) in enumerate(items):
        outcome = box.wait(i, worker, timeout_s)
        if isinstance(outcome, GradeResult):
            results.append(outcome)
            continue
        results.append(entries[i].wrong)
        if outcome is _TIMED_OUT:
            stats.num_timeouts += 1
            if i + 1 < len(items):
                worker = _start_worker(items, entries, box, first=i + 1)
        else:
            stats.num_errors += 1
            if stats.first_error is None:
                stats.first_error = f"{source}: {type(outcome).__name__}: {outcome}"
    stats.seconds = time.monotonic() - start
    if stats.num_errors or stats.num_timeouts:
        logger.warning(
            "rewards: %d of %d responses scored wrong by grader failure (%d errors, %d timeouts "
            "past %.3g s); first error: %s",
            stats.num_errors + stats.num_timeouts,
            stats.num_responses,
            stats.num_errors,
            stats.num_timeouts,
            timeout_s,
            stats.first_error,
        )
    return results, stats


def _entry(name: str) -> _Entry:
    if name not in _GRADERS:
        raise ValueError(f"no grader named {name!r}; registered: {registered_graders()}")
    return _GRADERS[name]


_TIMED_OUT = object()


class _Mailbox:
    """Outcomes by item (a GradeResult, an exception, or None while pending) and who runs what."""

    def __init__(self, n: int) -> None:
        self.cond = threading.Condition()
        self.outcomes: list[object] = [None] * n

    def wait(self, i: int, worker: _Worker, timeout_s: float) -> object:
        """Item i's outcome, or _TIMED_OUT once the worker has been on it for timeout_s."""
        with self.cond:
            while self.outcomes[i] is None:
                # The worker publishes item i - 1 and moves to i in one locked step.
                assert worker.current == i, (worker.current, i)
                remaining = timeout_s - (time.monotonic() - worker.started_at)
                if remaining <= 0:
                    worker.abandoned = True  # under the lock: it can publish nothing more
                    return _TIMED_OUT
                self.cond.wait(remaining)
            return self.outcomes[i]


class _Worker(threading.Thread):
    """Grades items[first:] in order, publishing each outcome and moving on in one locked step."""

    def __init__(
        self,
        items: Sequence[tuple[str, str, str]],
        entries: Sequence[_Entry],
        box: _Mailbox,
        first: int,
    ) -> None:
        super().__init__(name="vapo-grader", daemon=True)
        self.items, self.entries, self.box = items, entries, box
        self.current, self.started_at = first, time.monotonic()
        """The item being graded and since when."""
        self.abandoned = False
        """Set by the waiting thread on a timeout: publish nothing more, stop after this item."""

    def run(self) -> None:
        i = self.current
        while i < len(self.items):
            _, response, ground_truth = self.items[i]
            try:
                outcome: object = self.entries[i].fn(response, ground_truth)
                if not isinstance(outcome, GradeResult):
                    outcome = TypeError(
                        f"grader returned {type(outcome).__name__}, not GradeResult"
                    )
            except Exception as error:  # a grader bug scores wrong; it must not end the step
                outcome = error
            with self.box.cond:
                if self.abandoned:
                    return
                self.box.outcomes[i] = outcome
                i += 1
                self.current, self.started_at = i, time.monotonic()
                self.box.cond.notify_all()


def _start_worker(
    items: Sequence[tuple[str, str, str]], entries: Sequence[_Entry], box: _Mailbox, first: int
) -> _Worker:
    worker = _Worker(items, entries, box, first)
    worker.start()
    return worker


register_grader("dapo_math", dapo_math.grade)
register_grader("long_trace", long_trace.grade, wrong=long_trace.WRONG)
