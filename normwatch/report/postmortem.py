"""After each flush: detect triggers, ask for a verdict, write the post-mortem.

The decisions (spike test, blame) are pure and live in :mod:`normwatch.judge.spikes` and
:mod:`normwatch.judge.blame`; this module holds the state between flushes (history ring, loss
log, episode flags) and the side effects (logging, report folders, the console summary).
Nothing here may take training down: a failing report is one warning.
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
from normwatch.judge.spikes import Spike, SpikeDetector
from normwatch.records import Alarm, NormLayer, Snapshot, Trigger, UpdateStats, Verdict
from normwatch.report.document import build_report, write_report

LOSS_LOG = 4096
PRIORITY: tuple[Trigger, ...] = ("nonfinite_activation", "nonfinite_loss", "loss_spike",
                                 "critical_alarm")


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
        for alarm in passed:
            key = (alarm.kind, alarm.layer)
            if alarm.severity == "critical" and key not in self._reported_alarms:
                self._reported_alarms.add(key)
                triggers.setdefault("critical_alarm", alarm.step)
        if not triggers or not conclude:
            return []
        trigger = next(t for t in PRIORITY if t in triggers)
        return [self._conclude(trigger, triggers[trigger], order)]

    def on_exception(self, exc: BaseException, step: int, order: Sequence[str]) -> Verdict:
        """An exception reported by the training loop or an integration."""
        return self._conclude("exception", step, order, exc)

    def _conclude(self, trigger: Trigger, step: int, order: Sequence[str],
                  exc: BaseException | None = None) -> Verdict:
        records = self.history.records(since_step=step - self.config.blame_lookback)
        verdict = judge(trigger, step, records, order, list(self.updates))
        self.verdicts.append(verdict)
        self._logger.warning("[verdict] %s at step %d: %s%s. %s", trigger, step, verdict.blame,
                             f" ({verdict.layer})" if verdict.layer else "",
                             " ".join(verdict.evidence[:2]))
        wanted = trigger != "loss_spike"  # finite spikes get a verdict, not a post-mortem
        if wanted and self.config.report_dir is not None and \
                len(self.reports) < self.config.max_reports:
            self._write(verdict, order, exc)
        return verdict

    def _write(self, verdict: Verdict, order: Sequence[str], exc: BaseException | None) -> None:
        try:
            report = self.build(verdict, order, exc)
            from normwatch.report.html import render_html

            folder = write_report(report, self.config.report_dir or ".", render_html(report))
            self.reports.append(folder)
            self._logger.warning("[report] post-mortem written to %s", folder)
            if self.config.report_console:
                from normwatch.report.console import ReportSummary, stderr_console

                stderr_console().print(ReportSummary(report, folder))
        except Exception as exc_:  # a report must never take training down
            warnings.warn(f"normwatch: writing the post-mortem failed ({type(exc_).__name__}: "
                          f"{exc_}); training continues", RuntimeWarning, stacklevel=4)

    def build(self, verdict: Verdict | None, order: Sequence[str],
              exc: BaseException | None = None) -> dict[str, Any]:
        """The report document for ``verdict`` from the current history."""
        trigger = verdict.trigger if verdict else "manual"
        step = verdict.step if verdict else (self.history.records()[-1].snapshot.step
                                             if len(self.history) else 0)
        return build_report(
            trigger=trigger, step=step, verdict=verdict, layers=self.layers, order=order,
            records=self.history.records(), alarms=self.alarm_log,
            losses=list(self.losses), spikes=list(self.spikes), rank=self.config.rank,
            exception=exc, limits=self.config.limits, updates=list(self.updates),
            placement=self.config.placement,
        )

    def state_dict(self) -> dict[str, Any]:
        """Plain state: the spike baseline and how many verdicts/reports were made."""
        return {"spikes": self.detector.state_dict(), "verdicts": len(self.verdicts),
                "reported_alarms": sorted([k, v or ""] for k, v in self._reported_alarms)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detector.load_state_dict(state["spikes"])
        self._reported_alarms = {(k, v or None) for k, v in state.get("reported_alarms", [])}
