"""The log lines of a flush: grouped alarms, verdicts, incidents; and the user's alarm
sinks (``sinks=``).

    >>> log = AlarmLog(config)        # a sink of the watch (:mod:`normwatch.pipeline`)
    >>> log.on_flush(flush)           # "[fp16_headroom] 3 layers, ...", "[verdict] ..."

Which alarms pass and how they group is decided before (:mod:`normwatch.judge.dedup`);
this sink only writes ``flush.lines`` to the logger at their severity and hands them to
each user sink. A user sink that raises is switched off with one warning.
"""

from __future__ import annotations

import logging

from normwatch.config import WatchConfig
from normwatch.guarded import Part
from normwatch.pipeline import Flush

_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "critical": logging.CRITICAL}


class AlarmLog:
    """Logs each flush's alarm lines and the court's ruling; feeds the user sinks."""

    def __init__(self, config: WatchConfig) -> None:
        self.logger = logging.getLogger(config.logger)
        self._sinks = [(sink, Part(f"the alarm sink {sink!r}",
                                   "it is switched off for this watch"))
                       for sink in config.sinks]

    def on_flush(self, flush: Flush) -> None:
        for alarm in flush.lines:
            self.logger.log(_LEVELS[alarm.severity], "[%s] %s", alarm.kind, alarm.message)
            for sink, part in self._sinks:
                part.run(lambda s=sink, a=alarm: s(a))  # type: ignore[misc]
        self._ruling(flush)

    def on_exception(self, flush: Flush, exc: BaseException) -> None:
        self._ruling(flush)

    def close(self) -> None:
        pass

    def _ruling(self, flush: Flush) -> None:
        ruling = flush.ruling
        if ruling is None or ruling.incident is None:
            return
        incident = ruling.incident
        if ruling.opened:
            verdict = incident.verdict
            self.logger.warning("[verdict] %s at step %d: %s%s. %s", verdict.trigger,
                                verdict.step, verdict.blame,
                                f" ({verdict.layer})" if verdict.layer else "",
                                " ".join(verdict.evidence[:2]))
            return
        for event in ruling.events:
            self.logger.warning("[incident %d] %s; %s", incident.number, event.note,
                                f"its verdict is now that of step {incident.verdict.step}"
                                if ruling.refined else
                                f"the verdict of step {incident.verdict.step} stands")
