"""One incident, one verdict: triggers that follow a first one join it (pure).

    >>> book = Incidents(quiet_flushes=5)
    >>> book.observe({"critical_alarm": 63}, healthy=False)   # opens incident 1
    Opened(...)
    >>> book.observe({"nonfinite_loss": 135}, healthy=False)  # joins it
    Joined(...)

A run that goes wrong usually says so several times: a critical alarm, an output
mismatch, a non-finite gradient, then a NaN loss. Each is evidence of one fault, not a
new fault; judging each alone gives verdicts that contradict each other (a NaN gradient
born of a NaN forward looks like an optimizer blow-up). So the first trigger *opens* an
incident and is judged; later triggers, until the run has been healthy for
``quiet_flushes`` flushes in a row, *join* it: they go into its timeline, and its verdict
stands. An incident whose verdict explained nothing (``inconclusive``, or no cause) takes
the first later verdict that does: that refines it, it does not contradict it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from normwatch.records import Alarm, Trigger, Verdict

PRIORITY: tuple[Trigger, ...] = ("nonfinite_activation", "nonfinite_loss", "loss_spike",
                                 "critical_alarm")
"""Which of a flush's triggers is judged when several fire at once."""


@dataclass(frozen=True)
class Event:
    """One trigger in an incident's timeline."""

    trigger: Trigger
    step: int
    note: str = ""
    """What it added (empty for the trigger that opened the incident)."""
    what: str = ""
    """The alarm behind a ``critical_alarm`` (``kind in layer``), else empty."""


@dataclass
class Incident:
    """A run of triggers judged as one fault."""

    number: int
    """1, 2, ... in the order incidents opened."""
    verdict: Verdict
    events: list[Event] = field(default_factory=list)
    quiet: int = 0
    """Healthy flushes in a row since the last trigger."""
    closed: bool = False

    @property
    def first_step(self) -> int:
        return self.events[0].step

    @property
    def explained(self) -> bool:
        """Whether the verdict names a cause (else a later one may refine it)."""
        return explains(self.verdict)


def explains(verdict: Verdict) -> bool:
    """Whether ``verdict`` names a cause: not ``inconclusive``, and a ``cause``."""
    return verdict.blame != "inconclusive" and verdict.cause is not None


@dataclass(frozen=True)
class Opened:
    """A new incident: judge ``trigger`` at ``step``."""

    trigger: Trigger
    step: int


@dataclass(frozen=True)
class Joined:
    """Triggers joined the open incident (``events``, in step order)."""

    incident: Incident
    events: tuple[Event, ...]


def first_trigger(triggers: Mapping[Trigger, int]) -> Trigger:
    """The trigger to judge among a flush's (see :data:`PRIORITY`)."""
    return next(t for t in PRIORITY if t in triggers)


class Incidents:
    """The incidents of one watch; :meth:`observe` once per flush."""

    def __init__(self, quiet_flushes: int) -> None:
        self.quiet_flushes = quiet_flushes
        self.all: list[Incident] = []

    @property
    def open(self) -> Incident | None:
        """The incident still open, if any."""
        last = self.all[-1] if self.all else None
        return None if last is None or last.closed else last

    def observe(self, triggers: Mapping[Trigger, int], healthy: bool,
                what: Mapping[Trigger, str] | None = None) -> Opened | Joined | None:
        """One flush: its ``triggers`` (trigger → step; ``what``: trigger → the alarm
        behind it) and whether it was healthy (no critical alarm). Opens an incident,
        joins the open one, or nothing (an open incident closes after ``quiet_flushes``
        healthy flushes in a row without a trigger)."""
        current = self.open
        if current is None:
            if not triggers:
                return None
            trigger = first_trigger(triggers)
            return Opened(trigger, triggers[trigger])
        if not triggers:
            current.quiet = current.quiet + 1 if healthy else 0
            current.closed = current.quiet >= self.quiet_flushes
            return None
        current.quiet = 0
        what = what or {}
        events = tuple(sorted((Event(t, s, what=what.get(t, "")) for t, s in triggers.items()),
                              key=lambda e: (e.step, PRIORITY.index(e.trigger)
                                             if e.trigger in PRIORITY else len(PRIORITY))))
        return Joined(current, events)

    def start(self, verdict: Verdict, what: str = "") -> Incident:
        """Record the verdict of an :class:`Opened` incident (``what``: the alarm behind
        a ``critical_alarm``)."""
        incident = Incident(len(self.all) + 1, verdict,
                            [Event(verdict.trigger, verdict.step, what=what)])
        self.all.append(incident)
        return incident

    @staticmethod
    def extend(incident: Incident, events: tuple[Event, ...],
               verdict: Verdict | None = None) -> bool:
        """Add joined ``events``; ``verdict`` (judged at the last of them) replaces the
        incident's when that explained nothing and this one does. ``True``: replaced."""
        refined = verdict is not None and not incident.explained and explains(verdict)
        notes = [_note(e, incident) for e in events]
        incident.events += [Event(e.trigger, e.step, n, e.what)
                            for e, n in zip(events, notes, strict=True)]
        if refined:
            assert verdict is not None
            incident.verdict = verdict
            last = incident.events[-1]
            incident.events[-1] = Event(last.trigger, last.step,
                                        f"{notes[-1]}; it explained the incident: "
                                        f"{verdict.blame}, cause {verdict.cause}", last.what)
        return refined


def _note(event: Event, incident: Incident) -> str:
    what = f" ({event.what})" if event.what else ""
    return (f"{event.trigger.replace('_', ' ')}{what} at step {event.step}, "
            f"{event.step - incident.first_step} steps into incident {incident.number}")


RELATED: dict[str, frozenset[str]] = {
    "fp16_overflow": frozenset({"fp16_headroom", "fp16_overflow"}),
    "nonfinite": frozenset({"fp16_headroom", "fp16_overflow", "nonfinite"}),
    "eps_dominance": frozenset({"eps_dominance"}),
    "output_mismatch": frozenset({"output_mismatch", "dtype_mismatch"}),
    "stat_jump": frozenset({"fp16_headroom"}),
    "optimizer": frozenset({"fp16_headroom", "fp16_overflow", "gradient_headroom"}),
}
"""Per verdict cause, the alarm kinds that warn of that fault."""


def lead_warning(alarms: Sequence[Alarm], verdict: Verdict) -> Alarm | None:
    """The first warning (or worse) before ``verdict`` that was about the fault it found:
    an alarm of a kind that warns of its cause, on its layer when it blames one. ``None``
    when nothing warned of it (a warning of something else is no lead time)."""
    kinds = RELATED.get(verdict.cause or "", frozenset())
    layer = verdict.layer if verdict.blame == "normalization" else None
    found = [a for a in alarms if a.kind in kinds and a.step < verdict.step
             and a.severity in ("warning", "critical") and (layer is None or a.layer == layer)]
    return min(found, key=lambda a: a.step, default=None)
