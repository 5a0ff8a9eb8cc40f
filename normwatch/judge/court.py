"""Hears each flush and each exception, reaches verdicts: the run's judicial record (pure).

    >>> court = Court(config)
    >>> ruling = court.hear(snapshot, findings, passed, order)   # at each flush
    >>> ruling.verdicts                                          # none, or one
    >>> court.hear_exception(exc, step, order)                   # training raised

What triggers (a non-finite forward, a loss spike or NaN loss, a critical alarm) is
decided here; the verdict is :func:`normwatch.judge.blame.judge`'s, the incidents
:mod:`normwatch.judge.incidents`'. The court keeps what those read between flushes: the
history ring, the losses, the optimizer steps, the spikes, one trigger per episode. It
writes nothing: the :class:`~normwatch.pipeline.Flush` carries its :class:`Ruling` to
the sinks that log, print and write reports.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from normwatch.config import WatchConfig
from normwatch.judge.blame import judge
from normwatch.judge.depth import DepthProfile
from normwatch.judge.history import History
from normwatch.judge.incidents import Event, Incident, Incidents, Joined, Opened
from normwatch.judge.spikes import Spike, SpikeDetector
from normwatch.records import Alarm, Snapshot, Trigger, UpdateStats, Verdict

LOSS_LOG = 4096


@dataclass(frozen=True)
class Ruling:
    """What one flush (or an exception) did to the incidents."""

    incident: Incident | None = None
    """The incident opened or joined (``None``: nothing triggered)."""
    events: tuple[Event, ...] = ()
    """What this ruling added to its timeline (the opening event included)."""
    opened: bool = False
    refined: bool = False
    """The incident's verdict was replaced by this ruling's (it explained nothing)."""
    exception: BaseException | None = None

    @property
    def verdicts(self) -> tuple[Verdict, ...]:
        """The verdict reached: the new incident's, or the refined one (else none)."""
        if self.incident is not None and (self.opened or self.refined):
            return (self.incident.verdict,)
        return ()


class Court:
    """Triggers, verdicts and incidents of one watch."""

    def __init__(self, config: WatchConfig) -> None:
        self.config = config
        self.history = History(config.history_size)
        self.detector = SpikeDetector(config.spike_window, config.spike_warmup,
                                      config.spike_threshold, config.spike_min_rel)
        self.losses: deque[tuple[int, float]] = deque(maxlen=LOSS_LOG)
        self.updates: deque[UpdateStats] = deque(maxlen=LOSS_LOG)
        self.spikes: deque[Spike] = deque(maxlen=256)
        self.verdicts: list[Verdict] = []
        """One per incident: incident N's is ``verdicts[N - 1]``."""
        self.incidents = Incidents(config.incident_quiet)
        self._in_nonfinite = False
        self._in_nan_loss = False
        self._in_spike = False
        self._reported_alarms: set[tuple[str, str | None]] = set()

    def hear(self, snapshot: Snapshot, findings: Sequence[Alarm], passed: Sequence[Alarm],
             order: Sequence[str], profile: DepthProfile | None = None,
             conclude: bool = True) -> Ruling:
        """Record one flush (``findings`` before de-duplication, ``passed`` after,
        ``profile`` its depth profile); with ``conclude``, decide what its triggers do."""
        self.history.append(snapshot, findings, profile)
        triggers: dict[Trigger, int] = {}
        first = snapshot.first_nonfinite
        if first is not None and not self._in_nonfinite:
            triggers["nonfinite_activation"] = first.step
        self._in_nonfinite = first is not None
        self.updates.extend(snapshot.updates)
        for step, loss in snapshot.losses:
            self.losses.append((step, loss))
            spike = self.detector.observe(step, loss)
            if spike is not None:
                self.spikes.append(spike)
                # One trigger per episode: a run of consecutive spikes (or NaN losses).
                if spike.nonfinite and not self._in_nan_loss:
                    triggers.setdefault("nonfinite_loss", step)
                elif not spike.nonfinite and not self._in_spike:
                    triggers.setdefault("loss_spike", step)
            self._in_nan_loss = spike is not None and spike.nonfinite
            self._in_spike = spike is not None and not spike.nonfinite
        what: dict[Trigger, str] = {}
        for alarm in passed:
            key = (alarm.kind, alarm.layer)
            if alarm.severity == "critical" and key not in self._reported_alarms:
                self._reported_alarms.add(key)
                triggers.setdefault("critical_alarm", alarm.step)
                what.setdefault("critical_alarm", f"{alarm.kind} in {alarm.layer or 'the model'}")
        if not conclude:
            return Ruling()
        healthy = not any(a.severity == "critical" for a in findings)
        decision = self.incidents.observe(triggers, healthy, what)
        if isinstance(decision, Opened):
            return self._open(decision.trigger, decision.step, order,
                              what=what.get(decision.trigger, ""))
        if isinstance(decision, Joined):
            return self._join(decision.incident, decision.events, order)
        return Ruling()

    def hear_exception(self, exc: BaseException, step: int, order: Sequence[str]) -> Ruling:
        """An exception that ended training: it joins the open incident (whose verdict
        stands), else it opens one."""
        incident = self.incidents.open
        if incident is None:
            return self._open("exception", step, order, exc=exc)
        return self._join(incident, (Event("exception", step),), order, exc)

    def _judge(self, trigger: Trigger, step: int, order: Sequence[str]) -> Verdict:
        records = self.history.records(since_step=step - self.config.blame_lookback)
        return judge(trigger, step, records, order, list(self.updates))

    def _open(self, trigger: Trigger, step: int, order: Sequence[str], what: str = "",
              exc: BaseException | None = None) -> Ruling:
        incident = self.incidents.start(self._judge(trigger, step, order), what)
        self.verdicts.append(incident.verdict)
        return Ruling(incident, tuple(incident.events), opened=True, exception=exc)

    def _join(self, incident: Incident, events: tuple[Event, ...], order: Sequence[str],
              exc: BaseException | None = None) -> Ruling:
        """Add ``events`` to ``incident``; its verdict is refined when it explained
        nothing and the last event's does."""
        last = events[-1]
        candidate = None if incident.explained or last.trigger == "exception" else \
            self._judge(last.trigger, last.step, order)
        refined = Incidents.extend(incident, events, candidate)
        if refined:
            self.verdicts[incident.number - 1] = incident.verdict
        return Ruling(incident, tuple(incident.events[-len(events):]), refined=refined,
                      exception=exc)

    def state_dict(self) -> dict[str, Any]:
        """Plain state: the spike baseline and how many verdicts were reached."""
        return {"spikes": self.detector.state_dict(), "verdicts": len(self.verdicts),
                "reported_alarms": sorted([k, v or ""] for k, v in self._reported_alarms)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detector.load_state_dict(state["spikes"])
        self._reported_alarms = {(k, v or None) for k, v in state.get("reported_alarms", [])}
