"""Forecast when a growing max |x| reaches the fp16 limit (pure).

    >>> history = [(s, 20 * 1.05 ** s) for s in range(0, 40, 5)]
    >>> round(steps_to_limit(history, limit=256.0).steps)
    17

A forecast is worth a warning (:func:`worth_warning`) only when it is due within the
horizon *and* the value is near its limit: within ``ratio`` of it (the rule's stated
fraction, ``headroom_ratio``), or, for growth that is steady over a long history
(:data:`STEADY_POINTS` points fitting a line in log space with r² ≥ :data:`STEADY_R2`),
within :data:`STEADY_FRACTION` of it. A value orders of magnitude below its limit is
never a warning, however its trend extrapolates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MIN_POINTS = 4
MIN_R2 = 0.8
STEADY_POINTS = 8
STEADY_R2 = 0.97
STEADY_FRACTION = 1 / 64
"""A steady trend warns from 1/64 of the limit (|x| = 4 for the fp16 limit 256)."""


@dataclass(frozen=True)
class Forecast:
    """A log-linear trend of max |x| and the steps it leaves before ``limit``."""

    steps: float
    growth_per_step: float
    """Multiplicative growth of max |x| per optimizer step (1.01 = +1 %/step)."""
    r2: float
    points: int = 0
    """How many points the fit used."""


def worth_warning(value: float, limit: float, forecast: Forecast | None, ratio: float,
                  horizon: float) -> bool:
    """Whether a forecast of ``value`` reaching ``limit`` deserves a warning (see the
    module docstring)."""
    if forecast is None or forecast.steps > horizon:
        return False
    if value >= ratio * limit:
        return True
    steady = forecast.points >= STEADY_POINTS and forecast.r2 >= STEADY_R2
    return steady and value >= STEADY_FRACTION * limit


def steps_to_limit(history: Sequence[tuple[int, float]], limit: float) -> Forecast | None:
    """Fit log(max |x|) against step; ``None`` unless it is clearly growing.

    ``history`` holds ``(step, max |x|)`` pairs, oldest first; only positive finite
    values are used. A fit needs 4 points, a positive slope and r² >= 0.8.
    """
    points = [(float(s), math.log(v)) for s, v in history if v > 0 and math.isfinite(v)]
    if len(points) < MIN_POINTS:
        return None
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    syy = sum((p[1] - my) ** 2 for p in points)
    sxy = sum((p[0] - mx) * (p[1] - my) for p in points)
    if sxx <= 0 or syy <= 0:
        return None
    slope = sxy / sxx
    r2 = sxy * sxy / (sxx * syy)
    if slope <= 0 or r2 < MIN_R2:
        return None
    remaining = math.log(limit) - points[-1][1]
    return Forecast(max(remaining, 0.0) / slope, math.exp(slope), r2, n)
