"""Verdicts from real training loops (the demo's drills) and from crafted histories."""

from __future__ import annotations

import io
import statistics
from dataclasses import replace

from rich.console import Console

from normwatch.demos.demo import DemoResult, run_demo
from normwatch.judge.blame import judge
from normwatch.judge.history import Record
from normwatch.records import Alarm, LayerStats, Snapshot


def drill(fault: str, steps: int = 200) -> DemoResult:
    return run_demo(fault, steps=steps, console=Console(file=io.StringIO(), width=200),
                    live=False, report_dir="reports")


def test_fp16_reduction_overflow_blames_normalization_long_before_the_nan() -> None:
    result = drill("fp16-overflow")
    assert result.nan_step is not None
    final = result.verdicts[-1]
    assert final.trigger == "nonfinite_activation" and final.step == result.nan_step
    assert final.blame == "normalization" and final.cause == "fp16_overflow"
    overflowing = {a.layer for a in result.alarms
                   if a.kind == "fp16_overflow" and a.severity == "critical"}
    assert final.layer in overflowing
    assert any("squares its input in fp16" in e for e in final.evidence)
    warning = result.first_step("warning")
    assert warning is not None and result.nan_step - warning >= 10
    # ... and before the loss degrades: the first step whose 5-step median is 1.5x the best
    # 5-step median before it comes after the warning
    medians = [statistics.median(result.losses[max(0, i - 5):i])
               for i in range(1, len(result.losses) + 1)]
    degraded = next(i for i in range(10, len(medians) + 1)
                    if medians[i - 1] > 1.5 * min(medians[4:i - 1]))
    assert warning + 10 <= degraded < result.nan_step


def test_eps_zero_on_padding_blames_the_first_norm_that_sees_it() -> None:
    verdict = drill("eps-zero", steps=3).verdicts[0]
    assert (verdict.blame, verdict.layer, verdict.cause) == (
        "normalization", "blocks.0.norm1", "eps_dominance")
    assert "born inside 'blocks.0.norm1'" in verdict.evidence[0]


def test_nan_born_in_an_mlp_is_not_normalization_and_names_the_block() -> None:
    verdict = drill("nan-mlp", steps=40).verdicts[0]
    assert (verdict.trigger, verdict.step, verdict.blame) == (
        "nonfinite_activation", 30, "not_normalization")
    assert verdict.layer == "norm"
    assert verdict.block == "between blocks.1.norm2 and norm (inside blocks.1, after " \
        "blocks.1.norm2)"


def test_corrupted_batch_spike_is_not_normalization() -> None:
    result = drill("bad-batch", steps=100)
    assert [(v.trigger, v.step, v.blame) for v in result.verdicts] == [
        ("loss_spike", 80, "not_normalization")]
    assert "look in the data" in result.verdicts[0].evidence[1].lower()
    assert result.reports == []  # a finite spike gets a verdict, not a post-mortem


def test_healthy_run_has_no_verdict() -> None:
    result = drill("none", steps=150)
    assert result.verdicts == [] and result.reports == []


def stats(name: str, absmax: float, out_absmax: float) -> LayerStats:
    return LayerStats(
        name=name, kind="layernorm", calls=1, tokens=8, finite_tokens=8, stats_tokens=8,
        absmax=absmax,
        fp16_overflow_tokens=0, sumsq_max=absmax**2, rms_min=1.0, rms_mean=1.0, rms_max=1.0,
        eps_dominance=1e-6, eps_dominated_tokens=0, common_mode_max=0.1, common_mode_tokens=0,
        nonfinite=0, out_nonfinite=0, out_absmax=out_absmax, output_mismatch=None,
        output_eps=None,
        input_dtype="float32", weight_dtype="float32", output_dtype="float32", autocast=None,
    )


def history(last_in: float, last_out: float) -> list[Record]:
    records = [Record(Snapshot(s, s, {"a": stats("a", 5.0 + s % 2, 3.0),
                                      "b": stats("b", 4.0, 3.0)}), ()) for s in range(1, 8)]
    records.append(Record(Snapshot(8, 8, {"a": stats("a", last_in, last_out),
                                          "b": stats("b", 4.0, 3.0)}), ()))
    return records


def test_output_jump_blames_normalization_input_jump_is_inconclusive() -> None:
    out = judge("loss_spike", 8, history(5.0, 30.0), ["a", "b"])
    assert (out.blame, out.layer, out.cause) == ("normalization", "a", "stat_jump")
    assert "10.0x" in out.evidence[0]
    inp = judge("loss_spike", 8, history(60.0, 3.0), ["a", "b"])
    assert (inp.blame, inp.layer) == ("inconclusive", "a")
    calm = judge("loss_spike", 8, history(5.0, 3.0), ["a", "b"])
    assert (calm.blame, calm.layer, calm.cause) == ("not_normalization", None, None)


def test_norm_failure_alarm_outweighs_a_later_arrived_nan() -> None:
    records = history(5.0, 3.0)
    failure = Alarm("output_mismatch", "critical", "b", 5, 0.9, 0.01, "b: output differs. More.")
    records[4] = replace(records[4], findings=(failure,))
    verdict = judge("nonfinite_loss", 8, records, ["a", "b"])
    assert (verdict.blame, verdict.layer, verdict.cause) == (
        "normalization", "b", "output_mismatch")
    assert verdict.evidence[0] == "Step 5: output_mismatch (critical) in b. b: output differs."
