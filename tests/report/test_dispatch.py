"""The log sink: alarm lines at their severity, the user's sinks, the court's ruling."""

from __future__ import annotations

import logging

import pytest

from normwatch.config import WatchConfig
from normwatch.judge.court import Court
from normwatch.pipeline import Flush
from normwatch.records import Alarm, FirstNonfinite
from normwatch.report.dispatch import AlarmLog
from tests.factory import snapshot, stats


def alarm(kind: str = "eps_dominance", severity: str = "warning", step: int = 1) -> Alarm:
    return Alarm(kind, severity, "n", step, 0.5, 0.01, f"{kind} at {step}")  # type: ignore[arg-type]


def lines(*alarms: Alarm) -> Flush:
    return Flush(snapshot(1, stats("n")), lines=alarms)


def test_logs_at_the_alarm_severity(caplog: pytest.LogCaptureFixture) -> None:
    log = AlarmLog(WatchConfig(logger="normwatch.test"))
    with caplog.at_level(logging.INFO, logger="normwatch.test"):
        log.on_flush(lines(alarm(severity="critical"), alarm("common_mode", "info")))
    assert [(r.levelno, r.getMessage()[:14]) for r in caplog.records] == [
        (logging.CRITICAL, "[eps_dominance"), (logging.INFO, "[common_mode] ")]


def test_sinks_receive_alarms_and_a_broken_sink_is_disabled_once() -> None:
    got: list[Alarm] = []

    def broken(a: Alarm) -> None:
        raise RuntimeError("sink down")

    log = AlarmLog(WatchConfig(sinks=(broken, got.append)))
    with pytest.warns(RuntimeWarning, match=r"alarm sink .* failed \(RuntimeError: sink down\)"):
        log.on_flush(lines(alarm()))
    log.on_flush(lines(alarm("common_mode")))  # no second warning: the broken sink is off
    assert [a.kind for a in got] == ["eps_dominance", "common_mode"]


def test_a_verdict_and_what_joins_its_incident_are_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    config = WatchConfig(logger="normwatch.test")
    court, log = Court(config), AlarmLog(config)
    first = FirstNonfinite(2, "n", 1, "norm")
    sick = snapshot(2, stats("n", out_nonfinite=3), first_nonfinite=first)
    crit = Alarm("fp16_overflow", "critical", "n", 3, 300.0, 256.0, "overflow")
    with caplog.at_level(logging.WARNING, logger="normwatch.test"):
        log.on_flush(Flush(sick, ruling=court.hear(sick, [], [], ["n"])))
        later = snapshot(3, stats("n"))
        log.on_flush(Flush(later, ruling=court.hear(later, [crit], [crit], ["n"])))
    got = [r.getMessage() for r in caplog.records]
    assert got[0].startswith("[verdict] nonfinite_activation at step 2: normalization (n)")
    assert got[1].startswith("[incident 1] critical alarm (fp16_overflow in n) at step 3, "
                             "1 steps into incident 1; the verdict of step 2 stands")
