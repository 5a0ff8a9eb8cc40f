"""Alarms as people read them: one line per kind (and severity, tag) per flush.

    >>> groups = group_alarms(findings, order=watch.forward_order)
    >>> groups[0].text()
    '5 layers, blocks.0.norm1 … norm · steps to the limit 18.7–19.2 · worst ...'

A 60-layer model whose residual stream drifts raises the same alarm in every norm; the
console and the logs get one line naming the layers as a count and a range, with the
worst layer's explanation, while :attr:`~normwatch.watching.Watch.alarms`, ``report.json``
and the HTML keep every layer's alarm. Pure: no output here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from normwatch.records import Alarm


@dataclass(frozen=True)
class AlarmGroup:
    """The alarms of one kind, severity and tag raised at one flush, in forward order."""

    alarms: tuple[Alarm, ...]

    @property
    def kind(self) -> str:
        return self.alarms[0].kind

    @property
    def severity(self) -> str:
        return self.alarms[0].severity

    @property
    def step(self) -> int:
        return max(a.step for a in self.alarms)

    @property
    def layers(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(a.layer for a in self.alarms if a.layer is not None))

    @property
    def worst(self) -> Alarm:
        """The alarm with the worst value (the first one on ties): the largest, or for
        a headroom forecast the fewest steps to the limit."""
        if self.kind in _LOWER_IS_WORSE:
            return min(self.alarms, key=lambda a: a.value)
        return max(self.alarms, key=lambda a: a.value)

    def where(self) -> str:
        """``blocks.0.norm1`` for one layer, ``5 layers, blocks.0.norm1 … norm`` for more."""
        layers = self.layers
        if len(layers) <= 1:
            return layers[0] if layers else "model"
        if len(layers) == 2:
            return f"2 layers, {layers[0]}, {layers[1]}"
        return f"{len(layers)} layers, {layers[0]} … {layers[-1]}"

    def text(self, detail: bool = True) -> str:
        """The line: where, the range of values, and (``detail``) the worst layer's
        explanation. A group of one alarm reads as that alarm."""
        worst = self.worst
        if len(self.alarms) == 1:
            return worst.message if detail else _first_sentence(worst.message)
        values = [a.value for a in self.alarms]
        lo, hi = min(values), max(values)
        span = f"{_num(lo)}" if _num(lo) == _num(hi) else f"{_num(lo)}–{_num(hi)}"
        name = _VALUE_NAMES.get(f"{self.kind}/{worst.tag}", _VALUE_NAMES.get(self.kind))
        head = self.where() if name is None else f"{self.where()} · {name} {span}"
        if not detail:
            return head
        message = worst.message
        if worst.layer is not None and message.startswith(f"{worst.layer}: "):
            message = message[len(worst.layer) + 2:]
        return f"{head} · worst {worst.layer!r}: {message}"  # quoted: a layer named 'norm'

    def as_alarm(self, detail: bool = True, count: int = 1, since: int | None = None
                 ) -> Alarm:
        """The group as one :class:`Alarm` (for loggers and sinks): the worst layer's,
        with the group's line as its message."""
        message = self.text(detail)
        if count > 1 and since is not None:
            message += f" [x{count} since step {since}]"
        return dataclasses.replace(self.worst, step=self.step, message=message, count=count)


def group_alarms(alarms: Iterable[Alarm], order: Sequence[str] = ()) -> list[AlarmGroup]:
    """Group ``alarms`` by kind, severity and tag (in first-seen order), each group's
    layers in forward ``order`` (layers not in it last, as given)."""
    rank = {name: i for i, name in enumerate(order)}
    buckets: dict[tuple[str, str, str], list[Alarm]] = {}
    for alarm in alarms:
        buckets.setdefault((alarm.kind, alarm.severity, alarm.tag), []).append(alarm)
    return [AlarmGroup(tuple(sorted(found, key=lambda a: rank.get(a.layer or "", len(rank)))))
            for found in buckets.values()]


_LOWER_IS_WORSE = frozenset({"fp16_headroom"})
_VALUE_NAMES = {
    "fp16_headroom": "steps to the limit", "fp16_overflow/abs": "max |x|",
    "fp16_overflow/sumsq": "sum of squares", "nonfinite": "tokens",
    "eps_dominance": "eps/(s+eps)", "common_mode": "share of tokens",
    "output_mismatch": "error",
}
"""What an alarm's ``value`` is, by kind (``kind/tag`` where the tag changes it);
kinds without a value (``dtype_mismatch``) are left out."""


def _num(value: float) -> str:
    return f"{value:.4g}"


def _first_sentence(message: str) -> str:
    head, dot, _ = message.partition(". ")
    return head + dot.strip()
