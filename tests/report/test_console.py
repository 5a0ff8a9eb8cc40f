"""The health table, rendered into a fixed-width console and compared as text."""

from __future__ import annotations

import io

from rich.console import Console

from normwatch.records import Alarm, LayerStats, Snapshot
from normwatch.report.console import HealthTable, alarm_text


def stats(name: str, absmax: float, nonfinite: int = 0) -> LayerStats:
    return LayerStats(
        name=name, kind="rmsnorm", calls=1, tokens=8, finite_tokens=8, stats_tokens=8,
        absmax=absmax,
        fp16_overflow_tokens=0, sumsq_max=absmax**2, rms_min=0.5, rms_mean=1.0, rms_max=2.0,
        eps_dominance=1e-6, eps_dominated_tokens=0, common_mode_max=0.1, common_mode_tokens=0,
        nonfinite=nonfinite, out_nonfinite=0, out_absmax=3.0, output_mismatch=None, output_eps=None,
        input_dtype="float16", weight_dtype="float16", output_dtype="float16", autocast=None,
    )


def render(renderable: object, width: int = 110) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None).print(renderable)
    return buf.getvalue()


def test_worst_first_with_status_words() -> None:
    snap = Snapshot(step=10, first_step=6, layers={
        "a.norm": stats("a.norm", 3.0), "b.norm": stats("b.norm", 300.0),
        "c.norm": stats("c.norm", 12.0),
    })
    findings = [Alarm("fp16_overflow", "critical", "b.norm", 10, 300.0, 256.0, "x"),
                Alarm("fp16_headroom", "warning", "c.norm", 10, 50.0, 1000.0, "y")]
    text = render(HealthTable(snap, findings))
    lines = [line for line in text.splitlines() if "norm " in line]
    assert [line.split()[0].strip("|") for line in lines] == ["b.norm", "c.norm", "a.norm"]
    assert "CRIT" in lines[0] and "WARN" in lines[1] and "OK" in lines[2]
    assert "300" in lines[0] and "0.853" in lines[0]  # absmax and fp16_headroom = 256/300
    assert "steps 6-10" in text
    assert "f16>f16>f16" in lines[0]


def test_nonfinite_layers_are_critical_even_without_their_own_alarm() -> None:
    snap = Snapshot(step=3, first_step=3, layers={"a": stats("a", 1.0, nonfinite=5)})
    text = render(HealthTable(snap, []))
    assert "CRIT" in text
    assert "normwatch · step 3" in text and "steps 3-3" not in text  # one step: said so


def test_alarm_line() -> None:
    alarm = Alarm("nonfinite", "critical", "norm", 7, 1.0, 0.0, "First non-finite value")
    assert render(alarm_text(alarm)).strip() == "step 7 CRIT nonfinite: First non-finite value"


def test_demo_live_table_on_a_terminal() -> None:
    from normwatch.demos.demo import run_demo

    buf = io.StringIO()
    console = Console(file=buf, width=120, force_terminal=True, color_system="truecolor")
    result = run_demo("wrong-dim", steps=3, console=console, live=True)
    text = buf.getvalue()
    assert result.steps_run == 3
    assert "\x1b[" in text  # coloured, live-refreshed output
    assert "CRIT" in text and "output_mismatch" in text
