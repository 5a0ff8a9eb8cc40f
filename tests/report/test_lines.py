"""The one-line messages: attach, verdict, exit."""

from __future__ import annotations

from pathlib import Path

from normwatch.records import Alarm, Verdict
from normwatch.report.lines import attach_line, exit_line, verdict_line
from tests.factory import layer


def test_attach_line_names_the_model_its_norms_the_interval_and_the_reports() -> None:
    layers = [layer(f"blocks.{i}.norm") for i in range(3)] + [layer("norm", kind="layernorm")]
    assert attach_line("TinyLM", layers, 10, "runs/r") == (
        "normwatch: watching TinyLM: 4 norm layers (3 RMSNorm, 1 LayerNorm), flush every 10 "
        "steps, reports to runs/r")
    assert attach_line("Net", layers[:1], 1, None).endswith(
        "1 norm layer (1 RMSNorm), flush every 1 step, no reports")


def test_verdict_line_gives_trigger_blame_cause_and_first_evidence() -> None:
    v = Verdict("nonfinite_activation", 19, "not_normalization", "blocks.0.norm1", "optimizer",
                ("The optimizer step at step 18 moved the parameters by nan.", "more"))
    assert verdict_line(v) == (
        "normwatch VERDICT nonfinite activation at step 19: not normalization "
        "(blocks.0.norm1), cause optimizer: The optimizer step at step 18 moved the "
        "parameters by nan.")


def test_exit_line_counts_steps_alarms_by_severity_verdicts_and_reports() -> None:
    alarms = [Alarm("nonfinite", "critical", "a", 3, 1, 0, "m"),
              Alarm("fp16_overflow", "info", "a", 3, 1, 0, "m"),
              Alarm("fp16_overflow", "info", "b", 4, 1, 0, "m")]
    v = Verdict("nonfinite_loss", 5, "normalization", "a", "nonfinite", ())
    line = exit_line("GPT", 40, alarms, [v], [Path("r/one")], skipped=3)
    assert line == ("normwatch: GPT: 40 steps watched (3 skipped by the loss scaler); alarms: "
                    "1 critical, 2 info; verdicts: 1 (nonfinite_loss at 5: normalization); "
                    "reports: r/one")
    assert exit_line("GPT", 1, [], [], []) == \
        "normwatch: GPT: 1 step watched; alarms: none; verdicts: 0"
