"""The overflow forecast: a log-linear trend, quiet without one."""

from __future__ import annotations

import math

import pytest

from normwatch.judge.headroom import severity, steps_to_limit


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


@pytest.mark.parametrize(("value", "growth", "points", "every", "said"), [
    (70.0, 1.001, 4, 1, None),       # near (1/4 of 256), but ~1300 steps: past the horizon
    (70.0, 1.05, 16, 1, "warning"),  # near, 0.73 e-foldings seen, 1.3 to go: within 2x
    (80.0, 1.008, 16, 3, "info"),    # near, but 0.36 seen for 1.2 to go (healthy CTRL)
    (17.0, 1.07, 16, 10, "warning"),  # close (1/16), steady, 10 e-foldings seen
    (17.0, 1.07, 5, 10, "info"),     # close, but too few points to call it steady
    (5.3, 1.094, 16, 2, None),       # under 1/16 (the healthy fp16 Qwen3: ~43 steps)
])
def test_how_loud_a_forecast_is_said(value: float, growth: float, points: int, every: int,
                                     said: str | None) -> None:
    history = [(every * s, value / growth ** (every * (points - 1 - s))) for s in range(points)]
    forecast = steps_to_limit(history, 256.0)
    assert severity(value, 256.0, forecast, ratio=0.25, horizon=1000) == said
    # the same rule, scaled, for the gradients' limit 65504
    scaled = [(s, v * 65504 / 256) for s, v in history]
    assert severity(value * 65504 / 256, 65504.0, steps_to_limit(scaled, 65504.0), 0.25,
                    1000) == said
