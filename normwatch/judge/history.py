"""Host-side memory of recent flushes: the ring of records, the trends the rules read."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from normwatch.judge.depth import DepthProfile, worst_fp16_gradient
from normwatch.records import Alarm, FirstNonfinite, LayerStats, Snapshot


@dataclass(frozen=True)
class Record:
    """One flush: what was measured and what the rules found (before de-duplication)."""

    snapshot: Snapshot
    findings: tuple[Alarm, ...]
    profile: DepthProfile | None = None
    """The hidden-state gradient by depth at this flush (``None``: not measured)."""


class History:
    """The last ``size`` flushes, oldest first."""

    def __init__(self, size: int = 256) -> None:
        self._records: deque[Record] = deque(maxlen=size)

    def append(self, snapshot: Snapshot, findings: Sequence[Alarm],
               profile: DepthProfile | None = None) -> None:
        self._records.append(Record(snapshot, tuple(findings), profile))

    def __iter__(self) -> Iterator[Record]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def records(self, since_step: int | None = None) -> list[Record]:
        """Records whose interval ends at or after ``since_step`` (all if ``None``)."""
        return [r for r in self._records if since_step is None or r.snapshot.step >= since_step]

    def series(self, layer: str) -> list[tuple[int, LayerStats]]:
        """``(step, stats)`` of that layer, one per flush in which it was called."""
        out = []
        for record in self._records:
            stats = record.snapshot.layers.get(layer)
            if stats is not None and stats.seen:
                out.append((record.snapshot.step, stats))
        return out


def first_nonfinite(records: Sequence[Record]) -> FirstNonfinite | None:
    """The earliest first-non-finite event among ``records`` (oldest first)."""
    for record in records:
        if record.snapshot.first_nonfinite is not None:
            return record.snapshot.first_nonfinite
    return None


class Trends:
    """Per layer its max |x|, and the fp16 layers' largest gradient, at the last ``points``
    flushes: what the forecasts fit and the console's sparklines draw."""

    def __init__(self, layers: Sequence[str], points: int = 16) -> None:
        self.absmax: dict[str, deque[tuple[int, float]]] = {
            name: deque(maxlen=points) for name in layers}
        self.gradients: deque[tuple[int, float]] = deque(maxlen=points)
        """``(step, largest |dL/dy| of the fp16 layers)``, oldest first."""

    def record(self, snapshot: Snapshot) -> None:
        for name, stats in snapshot.layers.items():
            if stats.absmax is not None and name in self.absmax:
                self.absmax[name].append((snapshot.step, stats.absmax))
        worst = worst_fp16_gradient(snapshot)
        if worst is not None and worst.grad_out_absmax is not None:
            self.gradients.append((snapshot.step, worst.grad_out_absmax))

    def absmax_points(self) -> dict[str, tuple[tuple[int, float], ...]]:
        return {name: tuple(points) for name, points in self.absmax.items()}

    def sparklines(self) -> dict[str, tuple[float, ...]]:
        """Per layer the max |x| values alone, oldest first."""
        return {name: tuple(v for _, v in points) for name, points in self.absmax.items()}
