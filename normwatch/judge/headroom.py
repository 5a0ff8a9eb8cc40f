"""Forecast when a growing max |x| reaches the fp16 limit, and how loud to say it (pure).

    >>> history = [(s, 20 * 1.05 ** s) for s in range(0, 40, 5)]
    >>> round(steps_to_limit(history, limit=256.0).steps)
    17

A trend that reaches the limit within ``horizon`` steps is said (:func:`severity`):

- as a **warning** when acting now is right: the trend has covered at least half the
  distance it projects (:data:`REACH`: twice its growth over the points fitted, in
  e-foldings, is at least ln(limit / value)), and the value is
  *near* the limit (at least ``ratio`` of it, ``headroom_ratio``: 64 of 256) or *close*
  (at least :data:`CLOSE_FRACTION`, 16 of 256) on a steady trend (:data:`STEADY_POINTS`
  points on a line in log space, r² >= :data:`STEADY_R2`);
- as **info** otherwise. Measured on healthy runs: CTRL's norms at 80 growing 0.8 %/step
  (1.2 e-foldings to go after 0.3 seen): growth early in training levels off. The real
  overflows (a residual growing 7 %/step) have covered that distance before they are near;
- not at all below 1/16 of the limit: an fp16 Qwen3's final norm at 4.1 growing 11 %/step
  ("~38 steps" to 256, 4.1 e-foldings away) is early growth, not a forecast.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

MIN_POINTS = 4
MIN_R2 = 0.8
STEADY_POINTS = 8
STEADY_R2 = 0.97
CLOSE_FRACTION = 1 / 16
"""A steady trend warns from 1/16 of the limit (|x| = 16 for the fp16 limit 256); below
it a forecast is not said at all."""
REACH = 2.0
"""A warning extrapolates at most this many times the growth its points cover."""


@dataclass(frozen=True)
class Forecast:
    """A log-linear trend of max |x| and the steps it leaves before ``limit``."""

    steps: float
    growth_per_step: float
    """Multiplicative growth of max |x| per optimizer step (1.01 = +1 %/step)."""
    r2: float
    points: int = 0
    """How many points the fit used."""
    seen: float = 0.0
    """The growth the fit covers, in e-foldings (log slope x the steps its points span)."""


def severity(value: float, limit: float, forecast: Forecast | None, ratio: float,
             horizon: float) -> Literal["warning", "info"] | None:
    """How loud a forecast of ``value`` reaching ``limit`` is said (the module docstring's
    rule); ``None``: not at all."""
    if forecast is None or forecast.steps > horizon or value < CLOSE_FRACTION * limit:
        return None
    covered = REACH * forecast.seen >= math.log(limit / value)
    steady = forecast.points >= STEADY_POINTS and forecast.r2 >= STEADY_R2
    near = steady or value >= ratio * limit  # (close: past the floor above)
    return "warning" if covered and near else "info"


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
    return Forecast(max(remaining, 0.0) / slope, math.exp(slope), r2, n,
                    slope * (points[-1][0] - points[0][0]))
