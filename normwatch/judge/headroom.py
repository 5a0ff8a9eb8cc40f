"""Forecast when a growing max |x| reaches the fp16 limit (pure).

    >>> history = [(s, 20 * 1.05 ** s) for s in range(0, 40, 5)]
    >>> round(steps_to_limit(history, limit=256.0).steps)
    17
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MIN_POINTS = 4
MIN_R2 = 0.8


@dataclass(frozen=True)
class Forecast:
    """A log-linear trend of max |x| and the steps it leaves before ``limit``."""

    steps: float
    growth_per_step: float
    """Multiplicative growth of max |x| per optimizer step (1.01 = +1 %/step)."""
    r2: float


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
    return Forecast(max(remaining, 0.0) / slope, math.exp(slope), r2)
