"""Alarm routing: de-duplication with decimal backoff, logging, sinks, raising."""

from __future__ import annotations

import logging

import pytest

from normwatch.config import WatchConfig
from normwatch.errors import NumericalHealthError
from normwatch.records import Alarm
from normwatch.report.dispatch import Dispatcher


def alarm(kind: str = "eps_dominance", severity: str = "warning", step: int = 1,
          layer: str = "n", tag: str = "") -> Alarm:
    return Alarm(kind, severity, layer, step, 0.5, 0.01, f"{kind} at {step}", tag=tag)  # type: ignore[arg-type]


def test_repeats_back_off_by_powers_of_ten_with_counts() -> None:
    d = Dispatcher(WatchConfig())
    passed = [a for step in range(1, 1001) for a in d.deliver([alarm(step=step)])]
    assert [a.step for a in passed] == [1, 10, 100, 1000]
    assert [a.count for a in passed] == [1, 9, 90, 900]
    assert passed[1].message.endswith("[x9 since step 1]")
    assert d.history == passed


def test_a_rise_in_severity_always_passes_and_kinds_are_separate() -> None:
    d = Dispatcher(WatchConfig())
    assert d.deliver([alarm(severity="info")])
    assert not d.deliver([alarm(severity="info", step=2)])
    assert [a.severity for a in d.deliver([alarm(severity="critical", step=3)])] == ["critical"]
    assert d.deliver([alarm(kind="common_mode", step=4)])  # another kind: its own count
    assert d.deliver([alarm(layer="other", step=5)])       # another layer too


def test_dtype_mismatch_once_per_signature() -> None:
    d = Dispatcher(WatchConfig())
    first = alarm("dtype_mismatch", tag="bf16/f32")
    assert d.deliver([first])
    assert not any(d.deliver([alarm("dtype_mismatch", step=s, tag="bf16/f32")])
                   for s in range(2, 200))
    assert d.deliver([alarm("dtype_mismatch", step=300, tag="f16/f32")])


def test_logs_at_the_alarm_severity(caplog: pytest.LogCaptureFixture) -> None:
    d = Dispatcher(WatchConfig(logger="normwatch.test"))
    with caplog.at_level(logging.INFO, logger="normwatch.test"):
        d.deliver([alarm(severity="critical"), alarm("common_mode", "info")])
    assert [(r.levelno, r.getMessage()[:14]) for r in caplog.records] == [
        (logging.CRITICAL, "[eps_dominance"), (logging.INFO, "[common_mode] ")]


def test_sinks_receive_alarms_and_a_broken_sink_is_disabled_once() -> None:
    got: list[Alarm] = []

    def broken(a: Alarm) -> None:
        raise RuntimeError("sink down")

    d = Dispatcher(WatchConfig(sinks=(broken, got.append)))
    with pytest.warns(RuntimeWarning, match="sink .* raised RuntimeError: sink down"):
        d.deliver([alarm()])
    d.deliver([alarm("common_mode")])  # no second warning: the broken sink is off
    assert [a.kind for a in got] == ["eps_dominance", "common_mode"]


def test_raise_on_severity() -> None:
    d = Dispatcher(WatchConfig(raise_on="warning"))
    d.raise_if_fatal([alarm(severity="info")])
    with pytest.raises(NumericalHealthError, match=r"\[critical\] eps_dominance at 1") as info:
        d.raise_if_fatal([alarm(severity="critical")])
    assert [a.severity for a in info.value.alarms] == ["critical"]
    Dispatcher(WatchConfig()).raise_if_fatal([alarm(severity="critical")])  # None: never
