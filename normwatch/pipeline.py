"""A flush as one record, handed to every sink through one protocol.

    >>> flush = Flush(snapshot, findings=..., passed=..., lines=..., ruling=..., ...)
    >>> sinks = Sinks()
    >>> sinks.flush([log, console, writer, collector], flush)    # each sink's on_flush
    >>> sinks.exception([...], flush, exc)                        # training raised
    >>> sinks.close([...])

The watch builds the :class:`Flush` once (the read, the rules, de-duplication, the court's
ruling) and the sinks only act on it: the log lines, the console, the post-mortem writer,
the Prometheus collector, the trainers' logger metrics and the cross-rank verdict
exchange. A sink that raises is switched off with one warning (:mod:`normwatch.guarded`);
the others and training go on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from normwatch.guarded import Part
from normwatch.records import Alarm, GuardEvent, Limits, ReplayPoint, Snapshot, Verdict

if TYPE_CHECKING:
    from normwatch.judge.court import Ruling
    from normwatch.judge.depth import DepthProfile

BUILD_LOG = "normwatch.build"
"""The logger on which normwatch says, at INFO, that it is building its native parts (a
first run on a machine waits for it); the console view shows it."""


@dataclass(frozen=True)
class Flush:
    """Everything one flush measured and decided."""

    snapshot: Snapshot
    findings: Sequence[Alarm] = ()
    """The rules' findings, before de-duplication."""
    passed: Sequence[Alarm] = ()
    """The per-layer alarms that passed de-duplication (this flush's part of ``alarms``)."""
    lines: Sequence[Alarm] = ()
    """The grouped alarm lines to emit."""
    ruling: Ruling | None = None
    """What the court decided (``None``: nothing was judged)."""
    alarms: Sequence[Alarm] = ()
    """Every alarm that passed so far, oldest first."""
    verdicts: Sequence[Verdict] = ()
    """Every verdict so far, one per incident."""
    health: Sequence[Alarm] = ()
    """What each layer's health rests on: ``findings`` and the last output check's."""
    order: Sequence[str] = ()
    """Layer names in forward order."""
    placement: Mapping[str, str] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    profile: DepthProfile | None = None
    """The hidden-state gradient by depth (``None``: not measured)."""
    trends: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    """Per layer max |x| at the last flushes, oldest first."""
    guard: Sequence[GuardEvent] | None = None
    """With ``guard=True``: every poisoned step so far (``None``: no guard)."""
    replay: ReplayPoint | None = None
    """What re-runs the first step of the incident the ruling touched (``None``: none)."""
    rows: Sequence[Mapping[str, float]] = ()
    """Each layer's raw row (:data:`normwatch.catalog.RAW`), for combining across ranks."""
    regular: bool = False
    """At the ``flush_every`` cadence of ``step()``: every rank reaches it together
    (collectives are safe)."""
    last: bool = False
    """The run's last read (it ended or raised): nothing raises for ``raise_on``."""

    @property
    def guard_skipped(self) -> int | None:
        """How many optimizer steps the guard kept from the weights so far (``None``: no
        guard)."""
        return None if self.guard is None else sum(e.skipped for e in self.guard)

    @property
    def new_verdicts(self) -> tuple[Verdict, ...]:
        return () if self.ruling is None else self.ruling.verdicts


@runtime_checkable
class Sink(Protocol):
    """Where a flush goes."""

    def on_flush(self, flush: Flush) -> None: ...

    def on_exception(self, flush: Flush, exc: BaseException) -> None:
        """Training raised ``exc``; ``flush.ruling`` is the court's on it."""

    def close(self) -> None: ...


class Sinks:
    """Calls sinks, each guarded: one that raises is switched off with one warning."""

    def __init__(self) -> None:
        self._parts: dict[int, Part] = {}

    def flush(self, sinks: Iterable[Sink], flush: Flush) -> None:
        for sink in sinks:
            self._part(sink).run(lambda s=sink: s.on_flush(flush))  # type: ignore[misc]

    def exception(self, sinks: Iterable[Sink], flush: Flush, exc: BaseException) -> None:
        for sink in sinks:
            self._part(sink).run(lambda s=sink: s.on_exception(flush, exc))  # type: ignore[misc]

    def close(self, sinks: Iterable[Sink]) -> None:
        for sink in sinks:
            self._part(sink).run(sink.close)

    def _part(self, sink: Sink) -> Part:
        part = self._parts.get(id(sink))
        if part is None:
            part = self._parts[id(sink)] = Part(
                f"the sink {type(sink).__name__}", "it is switched off for this watch")
        return part
