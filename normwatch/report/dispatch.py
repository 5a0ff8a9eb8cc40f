"""Where alarms go: de-duplication, the logger, user sinks, and raising on request.

Two levels. Per layer, repeats of one alarm (same kind, layer and tag) are rate-limited
with a decimal backoff: the 1st, 10th, 100th, 1000th ... occurrence passes, carrying in
``count`` how many occurrences it stands for; a rise in severity always passes;
``dtype_mismatch`` passes once per layer and dtype signature. What passes is the history
(``watch.alarms``, the reports). The logger and the sinks get *groups*
(:mod:`normwatch.report.grouping`): one alarm per kind, severity and tag per flush, the layers
named as a count and a range, emitted when the group is new, when layers join it, and at
its 10th, 100th ... flush — so the output scales with the kinds, not the layers, and a
1,000-step NaN storm gives a handful of lines.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from normwatch.config import WatchConfig
from normwatch.errors import NumericalHealthError
from normwatch.records import SEVERITY_RANK, Alarm
from normwatch.report.grouping import group_alarms

_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "critical": logging.CRITICAL}
_ONCE_KINDS = frozenset({"dtype_mismatch"})


@dataclass
class _Seen:
    occurrences: int
    emitted_at: int
    severity: int
    first_step: int


@dataclass
class _GroupSeen:
    occurrences: int
    emitted_at: int
    first_step: int
    layers: set[str]


class Dispatcher:
    """Stateful alarm router; :meth:`deliver` returns the alarms that passed the filter."""

    def __init__(self, config: WatchConfig) -> None:
        self.config = config
        self.logger = logging.getLogger(config.logger)
        self._seen: dict[tuple[str, str | None, str], _Seen] = {}
        self._broken_sinks: set[int] = set()
        self._groups: dict[tuple[str, str, str], _GroupSeen] = {}
        self.history: list[Alarm] = []
        self.last_lines: list[Alarm] = []
        """The group lines the last :meth:`deliver` emitted."""

    def filter(self, alarms: Iterable[Alarm]) -> list[Alarm]:
        """Apply de-duplication and backoff; pure bookkeeping, no output."""
        passed = []
        for alarm in alarms:
            key = (alarm.kind, alarm.layer, alarm.tag)
            rank = SEVERITY_RANK[alarm.severity]
            seen = self._seen.get(key)
            if seen is None:
                self._seen[key] = _Seen(1, 1, rank, alarm.step)
                passed.append(alarm)
                continue
            seen.occurrences += 1
            if alarm.kind in _ONCE_KINDS and rank <= seen.severity:
                continue
            if rank > seen.severity or _is_power_of_ten(seen.occurrences):
                count = seen.occurrences - seen.emitted_at
                seen.emitted_at, seen.severity = seen.occurrences, max(rank, seen.severity)
                message = (f"{alarm.message} [x{count} since step {seen.first_step}]"
                           if count > 1 else alarm.message)
                passed.append(dataclasses.replace(alarm, count=count, message=message))
        return passed

    def grouped(self, alarms: Iterable[Alarm], order: Sequence[str] = ()) -> list[Alarm]:
        """The group lines to emit for one flush's ``alarms`` (see the module docstring):
        the first line of a group explains, later ones are short."""
        out = []
        for group in group_alarms(alarms, order):
            key = (group.kind, group.severity, group.worst.tag)
            seen = self._groups.get(key)
            if seen is None:
                self._groups[key] = _GroupSeen(1, 1, group.step, set(group.layers))
                out.append(group.as_alarm())
                continue
            seen.occurrences += 1
            joined = set(group.layers) - seen.layers
            if not joined and (group.kind in _ONCE_KINDS or
                               not _is_power_of_ten(seen.occurrences)):
                continue
            count = seen.occurrences - seen.emitted_at
            seen.emitted_at = seen.occurrences
            seen.layers |= joined
            out.append(group.as_alarm(detail=False, count=count, since=seen.first_step))
        return out

    def deliver(self, alarms: Iterable[Alarm], order: Sequence[str] = ()) -> list[Alarm]:
        """Filter into the history, log and hand the group lines to the sinks; returns
        the per-layer alarms that passed. ``order``: layer names in forward order."""
        alarms = list(alarms)
        passed = self.filter(alarms)
        self.history.extend(passed)
        self.last_lines = self.grouped(alarms, order)
        for alarm in self.last_lines:
            self.logger.log(_LEVELS[alarm.severity], "[%s] %s", alarm.kind, alarm.message)
            for sink in self.config.sinks:
                self._call_sink(sink, alarm)
        return passed

    def raise_if_fatal(self, passed: Iterable[Alarm]) -> None:
        """Raise :class:`NumericalHealthError` if ``raise_on`` says so."""
        threshold = self.config.raise_on
        if threshold is not None:
            fatal = [a for a in passed if SEVERITY_RANK[a.severity] >= SEVERITY_RANK[threshold]]
            if fatal:
                raise NumericalHealthError(fatal)

    def _call_sink(self, sink: object, alarm: Alarm) -> None:
        if id(sink) in self._broken_sinks:
            return
        try:
            sink(alarm)  # type: ignore[operator]
        except Exception as exc:  # a broken sink must not stop training
            self._broken_sinks.add(id(sink))
            warnings.warn(f"normwatch: alarm sink {sink!r} raised {type(exc).__name__}: {exc}; "
                          "it is disabled for this watch", RuntimeWarning, stacklevel=3)


def _is_power_of_ten(n: int) -> bool:
    while n >= 10 and n % 10 == 0:
        n //= 10
    return n == 1
