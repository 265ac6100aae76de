"""Batch-size controller: the paper's rule on synthetic timings, degenerate inputs, online mode."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from combee_stream.core.controller import (
    ControllerSettings,
    Decision,
    OnlineController,
    choose_batch_size,
    fit_power_law,
)

N = 500
GRID = (5, 10, 20, 40, 80)


def delays_for(A: float, alpha: float, sizes: tuple[int, ...] = GRID) -> dict[int, float]:
    """Per-iteration delays whose epoch time d * N / bs is exactly A * bs**-alpha."""
    return {bs: A * bs**-alpha * bs / N for bs in sizes}


def closed_form(bs_1: int, alpha: float, fraction: float = 0.016) -> float:
    return float(bs_1 * (1 / fraction) ** (1 / (alpha + 1)))


@pytest.mark.parametrize(("A", "alpha"), [(3000.0, 1.0), (120.0, 0.6), (9e4, 1.7), (1.0, 0.3)])
def test_fit_recovers_parameters_and_closed_form(A: float, alpha: float) -> None:
    settings = ControllerSettings(min_size=1, max_size=10_000)
    delays = delays_for(A, alpha)
    fit = fit_power_law(list(delays), [d * N / bs for bs, d in delays.items()])
    assert fit is not None
    assert fit.A == pytest.approx(A, rel=1e-9)
    assert fit.alpha == pytest.approx(alpha, rel=1e-9)

    decision = choose_batch_size(delays, N, settings)
    expected = closed_form(5, alpha)
    assert decision.target == pytest.approx(expected, rel=1e-9)
    assert decision.batch_size == round(expected)
    assert decision.tau == pytest.approx(0.016 * alpha * A * 5 ** -(alpha + 1), rel=1e-9)


@pytest.mark.parametrize(
    ("grid", "max_size", "expected"),
    [
        (GRID, 80, round(5 * 62.5**0.5)),  # 39.5 -> 40
        ((10, 20, 40, 80), 200, round(10 * 62.5**0.5)),  # 79
        ((10, 20, 40), 50, 50),  # 79 clipped to the upper bound
    ],
)
def test_perfectly_parallel_gives_7_9_times_smallest(
    grid: tuple[int, ...], max_size: int, expected: int
) -> None:
    settings = ControllerSettings(min_size=1, max_size=max_size, candidates=grid)
    decision = choose_batch_size({bs: 12.0 for bs in grid}, N, settings)  # constant delay
    assert decision.fit is not None and decision.fit.alpha == pytest.approx(1.0)
    assert decision.target == pytest.approx(grid[0] * 62.5**0.5)
    assert decision.batch_size == expected


def test_peak_slope_is_anchored_at_the_grid_not_the_measured_sizes() -> None:
    # A window that closed early at 2 traces must not halve bs*; nor do missing small sizes move it.
    settings = ControllerSettings(min_size=1, max_size=200)
    assert choose_batch_size({2: 3.0, 10: 3.0, 20: 3.0}, N, settings).batch_size == 40
    assert choose_batch_size({20: 3.0, 40: 3.0}, N, settings).batch_size == 40


def test_slow_scaling_is_clipped_to_max() -> None:
    settings = ControllerSettings(min_size=5, max_size=60)
    decision = choose_batch_size(delays_for(100.0, 0.2), N, settings)
    assert decision.target is not None and decision.target > 60
    assert decision.batch_size == 60
    assert "clipped" in decision.reason


def test_candidates_are_filtered_to_bounds() -> None:
    assert ControllerSettings(min_size=8, max_size=50).candidates == (10, 20, 40)
    assert ControllerSettings(min_size=1, max_size=3).candidates == (1, 3)
    assert ControllerSettings(candidates=(40, 5, 20)).candidates == (5, 20, 40)


DEGENERATE = {
    "empty": ({}, "2 sizes"),
    "one point": ({10: 1.0}, "2 sizes"),
    "flat epoch time": ({bs: 0.1 * bs for bs in GRID}, "does not fall"),
    "increasing epoch time": ({bs: 0.1 * bs**1.5 for bs in GRID}, "does not fall"),
    "zero": ({5: 1.0, 10: 0.0, 20: 1.0}, "positive and finite"),
    "negative": ({5: 1.0, 10: -2.0}, "positive and finite"),
    "nan": ({5: 1.0, 10: math.nan}, "positive and finite"),
    "inf": ({5: 1.0, 10: math.inf}, "positive and finite"),
    "non-positive size": ({0: 1.0, 10: 1.0}, "non-positive batch sizes"),
    "absurdly steep": ({277: 5.0, 279: 2.0}, "float range"),  # found by hypothesis
}


@pytest.mark.parametrize("case", DEGENERATE)
def test_degenerate_inputs_keep_smallest_size(case: str) -> None:
    delays, why = DEGENERATE[case]
    settings = ControllerSettings(min_size=2, max_size=80)
    decision = choose_batch_size(delays, N, settings)
    assert decision.batch_size == 5
    assert decision.reason.startswith("kept smallest size") and why in decision.reason
    assert decision.delays == delays


def test_zero_training_set_keeps_smallest() -> None:
    decision = choose_batch_size({5: 1.0, 10: 1.0}, 0, ControllerSettings())
    assert decision.batch_size == 5 and "n_train" in decision.reason


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"min_size": 0}, "min_size"),
        ({"min_size": 50, "max_size": 10}, "min_size"),
        ({"candidates": ()}, "candidates"),
        ({"candidates": (5, 5, 10)}, "candidates"),
        ({"candidates": (0, 5)}, "candidates"),
        ({"candidates": (-5, 5)}, "candidates"),
        ({"tau_fraction": 0.0}, "tau_fraction"),
        ({"tau_fraction": 1.0}, "tau_fraction"),
        ({"tau_fraction": math.nan}, "tau_fraction"),
        ({"ewma": 0.0}, "ewma"),
        ({"backlog_factor": 0.5}, "backlog_factor"),
    ],
)
def test_bad_settings_raise_naming_the_setting(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ControllerSettings(**kwargs)  # type: ignore[arg-type]


def test_settings_validate_when_decoded_from_config() -> None:
    with pytest.raises(msgspec.ValidationError, match="tau_fraction"):
        msgspec.convert({"tau_fraction": 2.0}, ControllerSettings)


def test_decision_round_trips_as_json() -> None:
    decision = choose_batch_size(delays_for(300.0, 0.8), N, ControllerSettings())
    assert msgspec.json.decode(msgspec.json.encode(decision), type=Decision) == decision


def settled(delay: float = 3.0, **kwargs: object) -> OnlineController:
    """A controller that explored the whole grid with a constant (perfectly parallel) delay."""
    ctl = OnlineController(ControllerSettings(**kwargs), key="k")  # type: ignore[arg-type]
    while ctl.exploring:
        ctl.observe(ctl.current(), delay)
    return ctl


def test_online_explores_grid_in_order_then_settles() -> None:
    ctl = OnlineController(ControllerSettings(), key="tenant-a")
    seen, decisions = [], []
    while ctl.exploring:
        seen.append(ctl.current())
        decisions.append(ctl.observe(ctl.current(), 3.0))
    assert seen == list(GRID)
    assert decisions[0] is None  # one size only: nothing to fit yet
    assert all(d is not None and d.batch_size == 40 for d in decisions[1:])
    assert ctl.current() == 40
    # Later windows keep refining the fit but, with the same timings, stay put.
    assert ctl.observe(40, 3.0) is not None and ctl.current() == 40


def test_online_settles_at_fitted_size_for_sublinear_scaling() -> None:
    A, alpha = 800.0, 0.7
    ctl = OnlineController(ControllerSettings(max_size=200))
    for bs, d in delays_for(A, alpha).items():
        assert ctl.current() == bs
        ctl.observe(bs, d)
    assert ctl.current() == round(closed_form(5, alpha))
    assert ctl.last is not None and ctl.last.fit is not None
    assert ctl.last.fit.alpha == pytest.approx(alpha)


def test_online_ewma_weights_new_delays() -> None:
    ctl = OnlineController(ControllerSettings(ewma=0.5))
    ctl.observe(5, 2.0)
    ctl.observe(5, 4.0)  # exploration advanced to 10 with 5 observed twice
    decision = ctl.observe(10, 3.0)
    assert decision is not None and decision.delays == {5: 3.0, 10: 3.0}


def test_online_rejects_bad_delays_without_advancing() -> None:
    ctl = OnlineController(ControllerSettings())
    for bad in (0.0, -1.0, math.nan, math.inf):
        assert ctl.observe(5, bad) is None
    assert ctl.current() == 5
    with pytest.raises(ValueError, match="batch_size"):
        ctl.observe(0, 1.0)


def test_backlog_grows_within_bounds_and_shrinks_back() -> None:
    ctl = settled(backlog_factor=2.0)
    assert ctl.fitted == 40
    assert ctl.backlog(80) == 40  # not beyond 2 x 40
    assert ctl.backlog(81) == 80  # min(pending, max_size)
    assert ctl.backlog(10_000) == 80 and ctl.current() == 80
    ctl = settled(max_size=200, backlog_factor=2.0)
    assert ctl.backlog(150) == 150
    assert ctl.backlog(90) == 90  # drains gradually while still over the threshold
    assert ctl.backlog(12) == 40 and ctl.current() == 40


def test_backlog_does_not_disturb_exploration() -> None:
    ctl = OnlineController(ControllerSettings())
    assert ctl.backlog(10_000) == 5
    ctl.observe(5, 1.0)
    assert ctl.backlog(10_000) == 10


positive_finite = st.floats(min_value=1e-9, max_value=1e9, allow_nan=False, allow_infinity=False)


@given(
    timings=st.dictionaries(st.integers(1, 500), positive_finite, max_size=8),
    bounds=st.tuples(st.integers(1, 100), st.integers(1, 400)).map(sorted),
    n_train=st.integers(1, 10**6),
)
def test_any_positive_finite_timings_stay_within_bounds(
    timings: dict[int, float], bounds: list[int], n_train: int
) -> None:
    settings = ControllerSettings(min_size=bounds[0], max_size=bounds[1])
    decision = choose_batch_size(timings, n_train, settings)
    assert settings.min_size <= decision.batch_size <= settings.max_size


@given(
    windows=st.lists(st.tuples(st.integers(1, 300), positive_finite), max_size=20),
    pending=st.integers(0, 10_000),
)
def test_online_sizes_stay_within_bounds(windows: list[tuple[int, float]], pending: int) -> None:
    settings = ControllerSettings(min_size=3, max_size=120)
    ctl = OnlineController(settings)
    for bs, d in windows:
        ctl.observe(bs, d)
        assert 3 <= ctl.current() <= 120
    assert 3 <= ctl.backlog(pending) <= 120
