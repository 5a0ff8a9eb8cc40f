"""Host-side records of one flush interval: plain data, no tensors."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from normwatch.discovery import Kind
from normwatch.stats import KEY_STRIDE, SCORE_BASE


@dataclass(frozen=True)
class LayerStats:
    """Statistics of one norm layer, aggregated since the previous flush.

    Value statistics cover the finite tokens; they are ``None`` when the layer saw
    none in the interval. ``rms_*`` are over per-token ``sqrt(mean(x²))``.
    """

    name: str
    kind: Kind
    calls: int
    tokens: int
    finite_tokens: int
    stats_tokens: int
    """Finite tokens measured with the full statistics (the rest: sentinel tier only)."""
    absmax: float | None
    fp16_overflow_tokens: int
    sumsq_max: float | None
    rms_min: float | None
    rms_mean: float | None
    rms_max: float | None
    eps_dominance: float | None
    eps_dominated_tokens: int
    common_mode_max: float | None
    common_mode_tokens: int
    nonfinite: int
    """Input tokens holding at least one NaN/inf."""
    out_nonfinite: int
    """Output tokens holding at least one NaN/inf."""
    out_absmax: float | None
    output_mismatch: float | None
    input_dtype: str | None
    weight_dtype: str | None
    output_dtype: str | None
    autocast: str | None
    """``"<device>:<dtype>"`` when the last call ran under autocast, else ``None``."""

    @property
    def seen(self) -> bool:
        """Whether the layer was called (and counted) in the interval."""
        return self.calls > 0


@dataclass(frozen=True)
class FirstNonfinite:
    """Where the first non-finite value of an interval showed up."""

    step: int
    layer: str
    position: int
    """The layer's index in forward order (0 = first norm the input meets)."""
    origin: Literal["input", "norm"]
    """``"input"``: it arrived in the norm's input; ``"norm"``: born inside the norm."""


@dataclass(frozen=True)
class Snapshot:
    """Everything one flush copied to the host."""

    step: int
    """The optimizer step the interval ended at (steps counted by ``watch.step``)."""
    first_step: int
    """The first step of the interval."""
    layers: Mapping[str, LayerStats]
    first_nonfinite: FirstNonfinite | None = None
    losses: tuple[tuple[int, float], ...] = field(default=())
    """``(step, loss)`` for each ``watch.step(loss)`` of the interval."""


def decode_score(score: float) -> tuple[int, int] | None:
    """``(step, call index)`` from a first-non-finite score, ``None`` for no event."""
    if not math.isfinite(score) or score <= 0:
        return None
    key = int(SCORE_BASE - score)
    return key // KEY_STRIDE, key % KEY_STRIDE


def optional(value: float) -> float | None:
    """An accumulator value, or ``None`` where it still holds a reduction identity."""
    return value if math.isfinite(value) else None
