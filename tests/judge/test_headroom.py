"""The overflow forecast: a log-linear trend, quiet without one."""

from __future__ import annotations

import math

import pytest

from normwatch.judge.headroom import steps_to_limit


def test_exponential_growth_is_forecast() -> None:
    history = [(s, 10 * 1.03**s) for s in range(0, 50, 5)]
    forecast = steps_to_limit(history, 256.0)
    assert forecast is not None
    expected = (math.log(256) - math.log(10 * 1.03**45)) / math.log(1.03)
    assert forecast.steps == pytest.approx(expected, rel=1e-9)
    assert forecast.growth_per_step == pytest.approx(1.03)


@pytest.mark.parametrize("history", [
    [(s, 50.0) for s in range(10)],                          # flat
    [(s, 100 * 0.98**s) for s in range(10)],                 # shrinking
    [(0, 10.0), (1, 12.0), (2, 11.0)],                       # too few points
    [(s, 50 + (20 if s % 2 else -20)) for s in range(10)],   # noise, no trend
])
def test_no_trend_no_forecast(history: list[tuple[int, float]]) -> None:
    assert steps_to_limit(history, 256.0) is None


def test_already_past_the_limit_is_zero_steps() -> None:
    forecast = steps_to_limit([(s, 200 * 1.1**s) for s in range(6)], 256.0)
    assert forecast is not None and forecast.steps == 0.0
