"""One incident, one verdict, one report: triggers after the first join it."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from normwatch.demos.demo import run_demo, summary
from normwatch.judge.blame import judge
from normwatch.judge.history import Record
from normwatch.judge.incidents import Event, Incidents, Joined, Opened, lead_warning
from normwatch.judge.updates import update_jump
from normwatch.records import Alarm, FirstNonfinite, UpdateStats, Verdict
from tests.factory import snapshot, stats


def verdict(trigger: str = "critical_alarm", step: int = 63, blame: str = "normalization",
            cause: str | None = "fp16_overflow") -> Verdict:
    return Verdict(trigger, step, blame, "blocks.0.norm", cause, ("e",))  # type: ignore[arg-type]


def test_later_triggers_join_until_the_run_is_quiet() -> None:
    book = Incidents(quiet_flushes=2)
    assert book.observe({}, healthy=True) is None
    opened = book.observe({"critical_alarm": 63}, healthy=False)
    assert opened == Opened("critical_alarm", 63)
    incident = book.start(verdict())
    joined = book.observe({"nonfinite_loss": 135, "nonfinite_activation": 134}, healthy=False)
    assert isinstance(joined, Joined) and joined.incident is incident
    assert [(e.trigger, e.step) for e in joined.events] == [
        ("nonfinite_activation", 134), ("nonfinite_loss", 135)]
    Incidents.extend(incident, joined.events)
    assert "71 steps into incident 1" in incident.events[1].note
    assert book.observe({}, healthy=False) is None  # a critical alarm still sounds
    assert book.observe({}, healthy=True) is None and book.open is incident
    assert book.observe({}, healthy=True) is None and book.open is None  # quiet twice
    assert isinstance(book.observe({"loss_spike": 400}, healthy=False), Opened)


def test_a_verdict_that_explained_nothing_is_refined_a_cause_never_replaced() -> None:
    book = Incidents(quiet_flushes=5)
    vague = book.start(verdict(blame="inconclusive", cause="stat_jump"))
    assert Incidents.extend(vague, (Event("nonfinite_loss", 80),),
                            verdict("nonfinite_loss", 80, "normalization", "eps_dominance"))
    assert vague.verdict.cause == "eps_dominance" and "explained the incident" in \
        vague.events[-1].note
    firm = Incidents(quiet_flushes=5).start(verdict())
    assert not Incidents.extend(firm, (Event("nonfinite_loss", 80),),
                                verdict("nonfinite_loss", 80, "not_normalization", "optimizer"))
    assert firm.verdict.cause == "fp16_overflow"


def test_a_nan_forward_is_never_blamed_on_the_optimizer_its_nan_gradient_fed() -> None:
    """The public GPT script's second report: the forward went NaN at step 277 (arrived in
    the first norm's input), its gradient was NaN, so the update was: that update is a
    consequence, not the cause."""
    first = FirstNonfinite(277, "blocks.0.ln_1", 0, "input")
    records = [Record(snapshot(s, stats("blocks.0.ln_1")), ()) for s in range(270, 277)]
    records.append(Record(snapshot(277, stats("blocks.0.ln_1", nonfinite=8, out_nonfinite=8),
                                   first_nonfinite=first), ()))
    updates = [UpdateStats(s, 0.5, 0.18, 40.0, 1e-3) for s in range(260, 277)]
    updates.append(UpdateStats(277, math.nan, math.nan, math.nan, 1e-3))
    assert update_jump(updates, 280) is not None  # the NaN update is there to be blamed
    got = judge("nonfinite_loss", 280, records, ["blocks.0.ln_1"], updates)
    assert (got.blame, got.cause) == ("not_normalization", "nonfinite")
    assert not any("optimizer" in e for e in got.evidence)


def test_a_nan_update_is_worded_as_such_without_clipping_advice() -> None:
    updates = [UpdateStats(s, 0.5, 0.18, 40.0, 1e-3) for s in range(1, 20)]
    updates.append(UpdateStats(20, math.nan, math.nan, math.nan, 1e-3))
    jump = update_jump(updates, 21)
    assert jump is not None
    text = " ".join(jump.sentences())
    assert "wrote non-finite values into the parameters" in text
    assert "gradient it received was not finite (NaN)" in text
    assert "nan" not in text.replace("NaN", "") and "clipping" not in text
    assert "x the median" not in text


def test_the_lead_time_counts_only_warnings_of_the_fault_that_happened() -> None:
    alarms = [Alarm("gradient_headroom", "warning", "head", 22, 558.0, 1000.0, "noise"),
              Alarm("fp16_headroom", "warning", "blocks.0.norm", 42, 90.0, 1000.0, "real"),
              Alarm("fp16_headroom", "warning", "blocks.1.norm", 30, 90.0, 1000.0, "other")]
    assert lead_warning(alarms, verdict(step=63)) == alarms[1]
    assert lead_warning(alarms, verdict(step=63, blame="not_normalization", cause="data")) \
        is None


@pytest.fixture()
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_demo_writes_one_post_mortem_for_its_one_incident(in_tmp: Path) -> None:
    """Before: four folders (critical alarm, output mismatch, gradient non-finite, NaN)."""
    out = io.StringIO()
    result = run_demo(console=Console(file=out, width=200), live=False,
                      report_dir="reports")
    assert result.nan_step is not None
    [folder] = result.reports
    assert len(list((in_tmp / "reports").iterdir())) == 1
    report = json.loads((folder / "report.json").read_text())
    [verdict_] = result.verdicts
    assert report["verdict"]["cause"] == verdict_.cause
    timeline = report["incident"]["timeline"]
    assert timeline[0]["step"] == verdict_.step and len(timeline) >= 2
    assert max(e["step"] for e in timeline) == result.nan_step
    text = summary(result)
    lead = lead_warning(result.alarms, verdict_)
    assert lead is not None and lead.kind != "gradient_headroom"
    assert f"warned {result.nan_step - lead.step} steps before the NaN loss" in text
