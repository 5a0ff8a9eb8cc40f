"""Verdicts from real training loops (the demo's drills) and from crafted histories."""

from __future__ import annotations

import io
import json
import math
import statistics
from dataclasses import replace

import torch
from rich.console import Console

import normwatch
from normwatch.demos.demo import DemoResult, run_demo, summary
from normwatch.judge.blame import judge
from normwatch.judge.history import Record
from normwatch.judge.updates import UPDATE_JUMP
from normwatch.records import Alarm, LayerStats, Snapshot, UpdateStats
from tests.conftest import tiny_hf


def drill(fault: str, steps: int = 200) -> DemoResult:
    return run_demo(fault, steps=steps, console=Console(file=io.StringIO(), width=200),
                    live=False, report_dir="reports")


def test_fp16_reduction_overflow_blames_normalization_long_before_the_nan() -> None:
    result = drill("fp16-overflow")
    assert result.nan_step is not None
    [final] = result.verdicts  # one incident: the critical alarm opened it, the NaN joined
    assert final.trigger == "critical_alarm" and final.step < result.nan_step
    assert final.blame == "normalization" and final.cause == "fp16_overflow"
    [folder] = result.reports
    incident = json.loads((folder / "report.json").read_text())["incident"]
    timeline = [(e["trigger"], e["step"]) for e in incident["timeline"]]
    assert timeline[0] == ("critical_alarm", final.step)
    assert ("nonfinite_activation", result.nan_step) in timeline
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


def test_corrupted_batch_spike_is_blamed_on_the_data() -> None:
    result = drill("bad-batch", steps=100)
    assert [(v.trigger, v.step, v.blame, v.cause) for v in result.verdicts] == [
        ("loss_spike", 80, "not_normalization", "data")]
    assert "optimizer steps before it were normal" in result.verdicts[0].evidence[1]
    assert "look at the batch" in result.verdicts[0].evidence[2].lower()
    assert result.reports == []  # a finite spike gets a verdict, not a post-mortem


def test_one_step_learning_rate_spike_is_blamed_on_the_optimizer() -> None:
    result = drill("lr-spike", steps=100)
    assert [(v.trigger, v.step, v.blame, v.layer, v.cause) for v in result.verdicts] == [
        ("loss_spike", 81, "not_normalization", None, "optimizer")]
    evidence = result.verdicts[0].evidence
    assert evidence[0].startswith("The optimizer step at step 80 moved the parameters")
    assert "the learning rate was 5, 100x its median 0.05" in evidence[1]
    assert "not_normalization[/], cause optimizer" in summary(result)  # the demo says why


def lr_blowup(optimizer_watched: bool) -> normwatch.Watch:
    """A tiny Llama trained with AdamW whose learning rate is 1000x for step 30."""
    model = tiny_hf("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = normwatch.watch(model, opt if optimizer_watched else None, flush_every=5,
                        report_dir=None)
    data = torch.randint(0, 64, (8, 4, 16), generator=torch.Generator().manual_seed(0))
    for step in range(1, 41):
        tokens = data[step % 8]
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = 1.0 if step == 30 else 1e-3
        opt.step()
        opt.zero_grad()
        w.step(loss)
    return w


def test_learning_rate_blowup_on_a_transformers_model_is_blamed_on_the_optimizer() -> None:
    w = lr_blowup(optimizer_watched=True)
    (verdict,) = w.verdicts
    assert (verdict.trigger, verdict.step, verdict.blame, verdict.cause) == (
        "loss_spike", 31, "not_normalization", "optimizer")
    jump = next(u for u in w.court.updates if u.step == 30)
    normal = [u.update_norm for u in w.court.updates if u.step < 30]
    assert jump.update_norm > 100 * max(normal) and jump.lr == 1.0
    assert "1000x its median 0.001" in verdict.evidence[1]
    assert "5 of 5 norms' inputs moved with it" in verdict.evidence[2]
    # without the optimizer's steps the same run can only shrug at the norm inputs' jump
    (blind,) = lr_blowup(optimizer_watched=False).verdicts
    assert (blind.blame, blind.cause) == ("inconclusive", "stat_jump")


def updates(*norms: float) -> list[UpdateStats]:
    return [UpdateStats(s, 1.0, n, 100.0, 1e-3) for s, n in enumerate(norms, 1)]


def test_update_jump_outranks_stat_jumps_but_not_a_failing_norm() -> None:
    steady = [0.1, 0.11, 0.09, 0.1, 0.1, 0.12]
    jumped = updates(*steady, 0.1 * UPDATE_JUMP * 2)  # step 7 jumped
    out = judge("loss_spike", 8, history(5.0, 30.0), ["a", "b"], jumped)
    assert (out.blame, out.layer, out.cause) == ("not_normalization", None, "optimizer")
    assert "8x the median" in out.evidence[0]
    assert out.evidence[1].startswith("None of the 2 norms' inputs moved much")
    # a jump 4 steps before the spike is too old to explain it; a small rise is no jump
    assert judge("loss_spike", 11, history(5.0, 30.0), ["a", "b"], jumped).cause == "stat_jump"
    assert judge("loss_spike", 8, history(5.0, 30.0), ["a", "b"],
                 updates(*steady, 0.1 * UPDATE_JUMP * 0.9)).cause == "stat_jump"
    nan = judge("loss_spike", 8, history(5.0, 3.0), ["a", "b"], updates(*steady, math.nan))
    assert nan.cause == "optimizer" and "wrote non-finite values" in nan.evidence[0]
    records = history(5.0, 3.0)
    failure = Alarm("eps_dominance", "warning", "b", 6, 0.5, 0.01, "b: eps dominates. More.")
    records[5] = replace(records[5], findings=(failure,))
    failing = judge("loss_spike", 8, records, ["a", "b"], jumped)
    assert (failing.blame, failing.layer, failing.cause) == (
        "normalization", "b", "eps_dominance")
    assert any("moved the parameters" in e for e in failing.evidence)  # as context


def test_normal_updates_and_healthy_norms_blame_the_data_unknown_updates_do_not() -> None:
    normal = updates(0.1, 0.11, 0.09, 0.1, 0.1, 0.12, 0.1)
    calm = judge("loss_spike", 8, history(5.0, 3.0), ["a", "b"], normal)
    assert (calm.blame, calm.cause) == ("not_normalization", "data")
    assert judge("loss_spike", 8, history(5.0, 3.0), ["a", "b"], normal[:3]).cause is None
    assert judge("loss_spike", 8, history(5.0, 3.0), ["a", "b"]).cause is None
    # a NaN loss with healthy norms could be the loss or the labels: not called data
    assert judge("nonfinite_loss", 8, history(5.0, 3.0), ["a", "b"], normal).cause is None



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
