"""Which alarms pass: de-duplication with a decimal backoff, and grouping into lines (pure
bookkeeping over host-side alarms; the output is :mod:`normwatch.report.dispatch`'s).

Two levels. Per layer, repeats of one alarm (same kind, layer and tag) are rate-limited
with a decimal backoff: the 1st, 10th, 100th, 1000th ... occurrence passes, carrying in
``count`` how many occurrences it stands for; a rise in severity always passes;
``dtype_mismatch`` passes once per layer and dtype signature. What passes is the history
(``watch.alarms``, the reports). The logger and the sinks get *lines*
(:mod:`normwatch.judge.grouping`): one alarm per kind, severity and tag per flush, the layers
named as a count and a range, emitted when the group is new, when layers join it, and at
its 10th, 100th ... flush — so the output scales with the kinds, not the layers, and a
1,000-step NaN storm gives a handful of lines.

    >>> dedup = Dedup()
    >>> passed, lines = dedup.sift(findings, order)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from normwatch.judge.grouping import group_alarms
from normwatch.records import SEVERITY_RANK, Alarm, Severity

ONCE_KINDS = frozenset({"dtype_mismatch"})
"""Kinds that pass once per layer and tag (a rise in severity passes again)."""


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


class Dedup:
    """The alarms' memory across flushes; :meth:`sift` decides one flush's."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str | None, str], _Seen] = {}
        self._groups: dict[tuple[str, str, str], _GroupSeen] = {}
        self.history: list[Alarm] = []
        """Every alarm that passed, oldest first (``watch.alarms``)."""

    def sift(self, alarms: Iterable[Alarm], order: Sequence[str] = ()
             ) -> tuple[list[Alarm], list[Alarm]]:
        """``(passed, lines)`` of one flush's findings: the per-layer alarms that pass
        (added to :attr:`history`) and the group lines to emit. ``order``: layer names in
        forward order."""
        alarms = list(alarms)
        passed = self.filter(alarms)
        self.history.extend(passed)
        return passed, self.grouped(alarms, order)

    def filter(self, alarms: Iterable[Alarm]) -> list[Alarm]:
        """The per-layer backoff (see the module docstring)."""
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
            if alarm.kind in ONCE_KINDS and rank <= seen.severity:
                continue
            if rank > seen.severity or _is_power_of_ten(seen.occurrences):
                count = seen.occurrences - seen.emitted_at
                seen.emitted_at, seen.severity = seen.occurrences, max(rank, seen.severity)
                message = (f"{alarm.message} [x{count} since step {seen.first_step}]"
                           if count > 1 else alarm.message)
                passed.append(dataclasses.replace(alarm, count=count, message=message))
        return passed

    def grouped(self, alarms: Iterable[Alarm], order: Sequence[str] = ()) -> list[Alarm]:
        """The group lines of one flush's ``alarms``: the first line of a group explains,
        later ones are short."""
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
            if not joined and (group.kind in ONCE_KINDS or
                               not _is_power_of_ten(seen.occurrences)):
                continue
            count = seen.occurrences - seen.emitted_at
            seen.emitted_at = seen.occurrences
            seen.layers |= joined
            out.append(group.as_alarm(detail=False, count=count, since=seen.first_step))
        return out


def fatal(passed: Iterable[Alarm], raise_on: Severity | None) -> list[Alarm]:
    """The alarms at or above ``raise_on`` (none when it is ``None``)."""
    if raise_on is None:
        return []
    return [a for a in passed if SEVERITY_RANK[a.severity] >= SEVERITY_RANK[raise_on]]


def _is_power_of_ten(n: int) -> bool:
    while n >= 10 and n % 10 == 0:
        n //= 10
    return n == 1
