"""After each flush: detect triggers, ask for a verdict, write the post-mortem.

The decisions (spike test, blame, incidents) are pure and live in
:mod:`normwatch.judge.spikes`, :mod:`normwatch.judge.blame` and
:mod:`normwatch.judge.incidents`; this module holds the state between flushes (history
ring, loss log, episode flags) and the side effects (logging, report folders, the console
summary). One incident, one verdict, one folder: a trigger that joins an open incident
adds to its timeline and rewrites its report. Nothing here may take training down: a
failing report is one warning.
"""

from __future__ import annotations

import logging
import warnings
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from normwatch.config import WatchConfig
from normwatch.judge.blame import judge
from normwatch.judge.history import History
from normwatch.judge.incidents import Event, Incident, Incidents, Joined, Opened
from normwatch.judge.spikes import Spike, SpikeDetector
from normwatch.records import Alarm, NormLayer, Snapshot, Trigger, UpdateStats, Verdict
from normwatch.report.document import build_report, write_report

LOSS_LOG = 4096


class PostMortem:
    """Triggers, verdicts and reports of one watch."""

    def __init__(self, config: WatchConfig, layers: Sequence[NormLayer],
                 alarm_log: list[Alarm]) -> None:
        self.config = config
        self.layers = tuple(layers)
        self.alarm_log = alarm_log
        """The watch's emitted (de-duplicated) alarms, reported as ``alarms``."""
        self.history = History(config.history_size)
        self.detector = SpikeDetector(config.spike_window, config.spike_warmup,
                                      config.spike_threshold, config.spike_min_rel)
        self.losses: deque[tuple[int, float]] = deque(maxlen=LOSS_LOG)
        self.updates: deque[UpdateStats] = deque(maxlen=LOSS_LOG)
        self.spikes: deque[Spike] = deque(maxlen=256)
        self.verdicts: list[Verdict] = []
        self.reports: list[Path] = []
        self._logger = logging.getLogger(config.logger)
        self._in_nonfinite = False
        self._in_nan_loss = False
        self._in_spike = False
        self._reported_alarms: set[tuple[str, str | None]] = set()
        self.incidents = Incidents(config.incident_quiet)
        self._folders: dict[int, Path] = {}
        """Incident number → its report folder."""

    def on_flush(self, snapshot: Snapshot, findings: list[Alarm], passed: list[Alarm],
                 order: Sequence[str], conclude: bool = True) -> list[Verdict]:
        """Record the flush; if something triggered (and ``conclude``), judge it and write
        a report. Returns the verdicts this flush reached (none or one)."""
        self.history.append(snapshot, findings)
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
            return []
        healthy = not any(a.severity == "critical" for a in findings)
        decision = self.incidents.observe(triggers, healthy, what)
        if isinstance(decision, Opened):
            return [self._open(decision.trigger, decision.step, order,
                               what=what.get(decision.trigger, ""))]
        if isinstance(decision, Joined):
            refined = self._join(decision.incident, decision.events, order)
            return [] if refined is None else [refined]
        return []

    def on_exception(self, exc: BaseException, step: int, order: Sequence[str]) -> Verdict:
        """An exception reported by the training loop or an integration: it joins the open
        incident (whose verdict stands), else it opens one."""
        incident = self.incidents.open
        if incident is None:
            return self._open("exception", step, order, exc)
        self._join(incident, (Event("exception", step),), order, exc)
        return incident.verdict

    def _judge(self, trigger: Trigger, step: int, order: Sequence[str]) -> Verdict:
        records = self.history.records(since_step=step - self.config.blame_lookback)
        return judge(trigger, step, records, order, list(self.updates))

    def _open(self, trigger: Trigger, step: int, order: Sequence[str],
              exc: BaseException | None = None, what: str = "") -> Verdict:
        verdict = self._judge(trigger, step, order)
        incident = self.incidents.start(verdict, what)
        self.verdicts.append(verdict)  # one per incident: incident N's is verdicts[N - 1]
        self._logger.warning("[verdict] %s at step %d: %s%s. %s", trigger, step, verdict.blame,
                             f" ({verdict.layer})" if verdict.layer else "",
                             " ".join(verdict.evidence[:2]))
        self._report(incident, order, exc)
        return verdict

    def _join(self, incident: Incident, events: tuple[Event, ...], order: Sequence[str],
              exc: BaseException | None = None) -> Verdict | None:
        """Add ``events`` to ``incident`` (and rewrite its report); the refined verdict
        when the incident's explained nothing and this flush's does, else ``None``."""
        last = events[-1]
        candidate = None if incident.explained or last.trigger == "exception" else \
            self._judge(last.trigger, last.step, order)
        refined = Incidents.extend(incident, events, candidate)
        for event in incident.events[-len(events):]:
            self._logger.warning("[incident %d] %s; %s", incident.number, event.note,
                                 f"its verdict is now that of step {incident.verdict.step}"
                                 if refined else
                                 f"the verdict of step {incident.verdict.step} stands")
        if refined:
            self.verdicts[incident.number - 1] = incident.verdict
        self._report(incident, order, exc)
        return incident.verdict if refined else None

    def _report(self, incident: Incident, order: Sequence[str],
                exc: BaseException | None) -> None:
        """Write the incident's post-mortem, or rewrite it in its folder. A finite loss
        spike alone gets a verdict, not a post-mortem."""
        wanted = any(e.trigger != "loss_spike" for e in incident.events)
        known = self._folders.get(incident.number)
        if not wanted or self.config.report_dir is None or \
                (known is None and len(self.reports) >= self.config.max_reports):
            return
        self._write(incident, order, exc, known)

    def _write(self, incident: Incident, order: Sequence[str],
               exc: BaseException | None, known: Path | None) -> None:
        """Write the report into a new folder, or over ``known``, the incident's."""
        try:
            report = self.build(incident.verdict, order, exc, incident)
            from normwatch.report.html import render_html

            folder = write_report(report, self.config.report_dir or ".", render_html(report),
                                  folder=known)
            if known is None:
                self._folders[incident.number] = folder
                self.reports.append(folder)
                self._logger.warning("[report] post-mortem written to %s", folder)
            else:
                self._logger.warning("[report] post-mortem of incident %d updated in %s",
                                     incident.number, folder)
            if self.config.report_console:
                from normwatch.report.console import ReportSummary, stderr_console

                stderr_console().print(ReportSummary(report, folder))
        except Exception as exc_:  # a report must never take training down
            warnings.warn(f"normwatch: writing the post-mortem failed ({type(exc_).__name__}: "
                          f"{exc_}); training continues", RuntimeWarning, stacklevel=4)

    def build(self, verdict: Verdict | None, order: Sequence[str],
              exc: BaseException | None = None,
              incident: Incident | None = None) -> dict[str, Any]:
        """The report document for ``verdict`` (of ``incident``) from the current
        history."""
        trigger = verdict.trigger if verdict else "manual"
        step = verdict.step if verdict else (self.history.records()[-1].snapshot.step
                                             if len(self.history) else 0)
        if incident is not None:  # named after what opened it
            trigger, step = incident.events[0].trigger, incident.first_step
        return build_report(
            trigger=trigger, step=step, verdict=verdict, layers=self.layers, order=order,
            records=self.history.records(), alarms=self.alarm_log,
            losses=list(self.losses), spikes=list(self.spikes), rank=self.config.rank,
            exception=exc, limits=self.config.limits, updates=list(self.updates),
            placement=self.config.placement, incident=incident,
        )

    def state_dict(self) -> dict[str, Any]:
        """Plain state: the spike baseline and how many verdicts/reports were made."""
        return {"spikes": self.detector.state_dict(), "verdicts": len(self.verdicts),
                "reported_alarms": sorted([k, v or ""] for k, v in self._reported_alarms)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detector.load_state_dict(state["spikes"])
        self._reported_alarms = {(k, v or None) for k, v in state.get("reported_alarms", [])}
