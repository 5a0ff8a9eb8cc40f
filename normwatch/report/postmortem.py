"""The post-mortem writer: one report folder per incident, rewritten as it grows.

    >>> writer = ReportWriter(config, layers, court, alarms)   # a sink of the watch
    >>> writer.on_flush(flush)     # a ruling that opened or joined an incident: write it

The decisions (triggers, verdicts, incidents) are the court's
(:mod:`normwatch.judge.court`); this sink turns the incident a ruling touched into
``report.json`` + ``report.html`` (and a console summary), in a new folder when it opened,
over its own folder when it joined. A finite loss spike alone gets a verdict, not a
post-mortem. Writing must never take training down: a failure is one warning and no more
reports.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from normwatch.config import WatchConfig
from normwatch.guarded import Part
from normwatch.judge.court import Court
from normwatch.judge.incidents import Incident
from normwatch.pipeline import Flush
from normwatch.records import Alarm, GuardEvent, NormLayer, ReplayPoint, Verdict
from normwatch.report.document import build_report, write_report


class ReportWriter:
    """Writes the post-mortems of one watch."""

    def __init__(self, config: WatchConfig, layers: Sequence[NormLayer], court: Court,
                 alarms: Sequence[Alarm], devices: Callable[[], list[str]] = list) -> None:
        self.config = config
        self.devices = devices
        """Where the watched model is now (read when a report is written)."""
        self.layers = tuple(layers)
        self.court = court
        self.alarms = alarms
        """The watch's emitted (de-duplicated) alarms, reported as ``alarms``."""
        self.reports: list[Path] = []
        self._folders: dict[int, Path] = {}
        """Incident number → its report folder."""
        self._logger = logging.getLogger(config.logger)
        self._part = Part("writing the post-mortem", "no more post-mortems are written")

    def on_flush(self, flush: Flush) -> None:
        self.on_exception(flush, None)

    def on_exception(self, flush: Flush, exc: BaseException | None) -> None:
        ruling = flush.ruling
        incident = None if ruling is None else ruling.incident
        if incident is None or self.config.report_dir is None or \
                not any(e.trigger != "loss_spike" for e in incident.events):
            return
        known = self._folders.get(incident.number)
        if known is None and len(self.reports) >= self.config.max_reports:
            return
        self._part.run(lambda: self._write(incident, flush, exc, known))

    def close(self) -> None:
        pass

    def _write(self, incident: Incident, flush: Flush, exc: BaseException | None,
               known: Path | None) -> None:
        """Write the report into a new folder, or over ``known``, the incident's."""
        report = self.build(incident.verdict, flush.order, exc, incident, flush.guard,
                            flush.replay)
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

    def build(self, verdict: Verdict | None, order: Sequence[str],
              exc: BaseException | None = None, incident: Incident | None = None,
              guard: Sequence[GuardEvent] | None = None,
              replay: ReplayPoint | None = None) -> dict[str, Any]:
        """The report document for ``verdict`` (of ``incident``) from the court's
        record."""
        court = self.court
        trigger = verdict.trigger if verdict else "manual"
        step = verdict.step if verdict else (court.history.records()[-1].snapshot.step
                                             if len(court.history) else 0)
        if incident is not None:  # named after what opened it
            trigger, step = incident.events[0].trigger, incident.first_step
        return build_report(
            trigger=trigger, step=step, verdict=verdict, layers=self.layers, order=order,
            records=court.history.records(), alarms=self.alarms,
            losses=list(court.losses), spikes=list(court.spikes), rank=self.config.rank,
            exception=exc, limits=self.config.limits, updates=list(court.updates),
            incident=incident, guard=guard, replay=replay, devices=self.devices(),
        )
