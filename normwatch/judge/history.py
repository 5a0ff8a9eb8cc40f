"""A bounded host-side ring buffer of recent flushes (snapshot + raw findings)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from normwatch.records import Alarm, FirstNonfinite, LayerStats, Snapshot


@dataclass(frozen=True)
class Record:
    """One flush: what was measured and what the rules found (before de-duplication)."""

    snapshot: Snapshot
    findings: tuple[Alarm, ...]


class History:
    """The last ``size`` flushes, oldest first."""

    def __init__(self, size: int = 256) -> None:
        self._records: deque[Record] = deque(maxlen=size)

    def append(self, snapshot: Snapshot, findings: list[Alarm]) -> None:
        self._records.append(Record(snapshot, tuple(findings)))

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
