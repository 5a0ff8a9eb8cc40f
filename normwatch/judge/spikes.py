"""Loss-spike detection over per-step losses: a robust rolling baseline (pure state).

    >>> detector = SpikeDetector()
    >>> for step, loss in enumerate(losses, 1):
    ...     spike = detector.observe(step, loss)

A loss is a spike when it exceeds the rolling median by more than ``threshold`` robust
standard deviations (1.4826 x MAD) *and* by more than ``min_rel`` of the median, after
``warmup`` finite losses. A non-finite loss is always a spike. Finite spikes enter the
window like any loss: the median shrugs off a few, and a lasting level shift becomes the
new baseline after about half a window. ``state_dict()``/``load_state_dict()`` round-trip
through JSON-able data.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

STATE_VERSION = 1


@dataclass(frozen=True)
class Spike:
    """One abnormal loss."""

    step: int
    loss: float
    baseline: float | None
    """Rolling median before this step (``None`` during warmup)."""
    margin: float | None
    """How far above the baseline counted as a spike."""

    @property
    def nonfinite(self) -> bool:
        return not math.isfinite(self.loss)


class SpikeDetector:
    """Rolling median/MAD spike test; see the module docstring."""

    def __init__(
        self, window: int = 50, warmup: int = 10, threshold: float = 6.0, min_rel: float = 0.1
    ) -> None:
        self.window = window
        self.warmup = warmup
        self.threshold = threshold
        self.min_rel = min_rel
        self._losses: deque[float] = deque(maxlen=window)
        self.spikes_seen = 0

    def observe(self, step: int, loss: float) -> Spike | None:
        """Feed one loss; return a :class:`Spike` if it is one."""
        if not math.isfinite(loss):
            self.spikes_seen += 1
            return Spike(step, loss, self.baseline(), None)
        if len(self._losses) >= self.warmup:
            median = statistics.median(self._losses)
            mad = statistics.median(abs(v - median) for v in self._losses)
            margin = max(self.threshold * 1.4826 * mad, self.min_rel * abs(median))
            if loss > median + margin:
                self.spikes_seen += 1
                self._losses.append(loss)
                return Spike(step, loss, median, margin)
        self._losses.append(loss)
        return None

    def baseline(self) -> float | None:
        """The current rolling median (``None`` before any finite loss)."""
        return statistics.median(self._losses) if self._losses else None

    def state_dict(self) -> dict[str, Any]:
        """Plain, JSON-able state."""
        return {"version": STATE_VERSION, "losses": list(self._losses),
                "spikes_seen": self.spikes_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (the window size stays this detector's)."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"spike detector state must be a dict with version {STATE_VERSION}:"
                             f" got {state!r:.80}")
        self._losses = deque((float(v) for v in state["losses"]), maxlen=self.window)
        self.spikes_seen = int(state["spikes_seen"])
