import math

import pytest
import torch

from vapo_megatron.algorithms.value_pretrain import ValuePretrainStop

pytestmark = pytest.mark.unit

NAN = float("nan")


def rule(**overrides) -> ValuePretrainStop:
    kwargs = dict(max_steps=50, min_steps=3, ev_threshold=0.5, patience=2, min_delta=0.01)
    return ValuePretrainStop(**{**kwargs, **overrides})


def first_stop(stop: ValuePretrainStop, evs) -> int | None:
    """The step (1-based) at which the rule says stop, or None."""
    for step, ev in enumerate(evs, start=1):
        if stop.update(step, ev):
            return step
    return None


def test_stops_at_max_steps_without_a_plateau():
    # Steadily improving: never settles, so only the budget stops it.
    assert first_stop(rule(max_steps=10), [0.05 * i for i in range(20)]) == 10


def test_stops_once_above_threshold_and_flat_for_patience_updates():
    evs = [0.1, 0.3, 0.6, 0.7, 0.705, 0.708, 0.9]
    # Best 0.7 at step 4; steps 5 and 6 rise by < 0.01: stale 2 = patience at step 6.
    assert first_stop(rule(), evs) == 6


def test_a_plateau_below_the_threshold_does_not_stop():
    assert first_stop(rule(max_steps=30), [0.2] * 40) == 30


def test_min_steps_comes_first():
    assert first_stop(rule(min_steps=8), [0.9] * 20) == 8
    assert first_stop(rule(min_steps=0), [0.9] * 20) == 3  # best at step 1, stale at 2 and 3


def test_current_ev_must_pass_the_threshold():
    # Flat best at 0.8, but the latest EV dropped below the threshold: keep training.
    evs = [0.8, 0.1, 0.1, 0.1, 0.8]
    assert first_stop(rule(min_steps=0), evs) == 5


def test_nan_never_passes_and_never_counts_as_plateau():
    # Degenerate returns (explained_variance NaN) every step: only max_steps stops it.
    assert first_stop(rule(max_steps=12), [NAN] * 20) == 12
    assert first_stop(rule(max_steps=12), [torch.tensor(NAN, dtype=torch.float64)] * 20) == 12
    # NaNs between flat good values do not add to the patience count, nor stop themselves.
    evs = [0.9, 0.9, NAN, NAN, NAN, 0.9]
    stop = rule(min_steps=0, patience=2)
    assert [stop.update(s, ev) for s, ev in enumerate(evs, start=1)] == [
        False, False, False, False, False, True,
    ]  # fmt: skip
    assert stop.stale == 2 and stop.best == 0.9
    assert first_stop(rule(min_steps=0), [-math.inf] * 5) is None


def test_state_dict_round_trip_resumes_the_same_decision():
    evs = [0.1, 0.6, 0.7, 0.702, 0.704, 0.705]
    whole = first_stop(rule(), evs)
    first = rule()
    for step, ev in enumerate(evs[:4], start=1):
        assert not first.update(step, ev)
    resumed = rule()
    resumed.load_state_dict(first.state_dict())
    later = [resumed.update(step, ev) for step, ev in enumerate(evs[4:], start=5)]
    assert whole == 5 and later == [True, True]
    with pytest.raises(ValueError, match="steps must increase"):
        resumed.update(6, 0.7)
    with pytest.raises(ValueError, match="keys"):
        resumed.load_state_dict({"best": 0.1})


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="max_steps"):
        rule(max_steps=0)
    with pytest.raises(ValueError, match="min_steps"):
        rule(min_steps=60)
    with pytest.raises(ValueError, match="at most 1"):
        rule(ev_threshold=1.5)
    with pytest.raises(ValueError, match="patience"):
        rule(patience=0)
    with pytest.raises(ValueError, match="min_delta"):
        rule(min_delta=-0.1)
