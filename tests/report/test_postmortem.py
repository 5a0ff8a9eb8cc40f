"""Triggers and verdicts (the court), report folders (the writer) from crafted flushes (no
model)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from normwatch.config import WatchConfig
from normwatch.judge.court import Court
from normwatch.pipeline import Flush
from normwatch.records import Alarm, FirstNonfinite, Snapshot, Verdict
from normwatch.report.console import ReportSummary
from normwatch.report.document import load_report, report_limits
from normwatch.report.html import render_html
from normwatch.report.postmortem import ReportWriter
from tests.factory import layer, snapshot, stats

ORDER = ["blocks.0.norm", "blocks.1.norm"]


class PostMortem:
    """The court and the writer, wired as a watch wires them."""

    def __init__(self, config: WatchConfig) -> None:
        self.court = Court(config)
        self.writer = ReportWriter(config, [layer(n) for n in ORDER], self.court, [])
        self.reports = self.writer.reports
        self.verdicts = self.court.verdicts

    def on_flush(self, snap: Snapshot, findings: list[Alarm], passed: list[Alarm],
                 order: list[str]) -> list[Verdict]:
        ruling = self.court.hear(snap, findings, passed, order)
        self.writer.on_flush(Flush(snap, ruling=ruling, order=order))
        return list(ruling.verdicts)

    def on_exception(self, exc: BaseException, step: int, order: list[str]) -> Verdict:
        ruling = self.court.hear_exception(exc, step, order)
        self.writer.on_exception(Flush(Snapshot(step, step, {}), ruling=ruling, order=order),
                                 exc)
        assert ruling.incident is not None
        return ruling.incident.verdict


def postmortem(tmp_path: Path, **options: object) -> PostMortem:
    return PostMortem(WatchConfig.from_options(report_dir=str(tmp_path / "reports"),
                                               report_console=False, **options))


def healthy(step: int, loss: float = 2.0, **fields: object) -> object:
    return snapshot(step, stats(ORDER[0], **fields), stats(ORDER[1]), losses=[(step, loss)])


def test_on_flush_returns_the_new_verdicts_once_per_episode(tmp_path: Path) -> None:
    pm = postmortem(tmp_path)
    assert pm.on_flush(healthy(1), [], [], ORDER) == []  # type: ignore[arg-type]
    first = FirstNonfinite(2, ORDER[1], 1, "norm")
    sick = snapshot(2, stats(ORDER[0]), stats(ORDER[1], out_nonfinite=3), first_nonfinite=first)
    new = pm.on_flush(sick, [], [], ORDER)
    assert [(v.trigger, v.blame, v.layer) for v in new] == [
        ("nonfinite_activation", "normalization", ORDER[1])]
    assert pm.verdicts == new
    again = snapshot(3, stats(ORDER[0]), stats(ORDER[1], out_nonfinite=3),
                     first_nonfinite=FirstNonfinite(3, ORDER[1], 1, "norm"))
    assert pm.on_flush(again, [], [], ORDER) == []  # the same episode
    assert len(pm.reports) == 1


def test_a_finite_spike_gets_a_verdict_but_no_report(tmp_path: Path) -> None:
    pm = postmortem(tmp_path, spike_warmup=3)
    for step in range(1, 6):
        assert pm.on_flush(healthy(step), [], [], ORDER) == []  # type: ignore[arg-type]
    new = pm.on_flush(healthy(6, loss=50.0), [], [], ORDER)  # type: ignore[arg-type]
    assert [v.trigger for v in new] == ["loss_spike"]
    assert pm.reports == []


def test_the_report_records_and_renders_the_limits_used(tmp_path: Path) -> None:
    pm = postmortem(tmp_path, fp16_limit=100.0, eps_tol=0.05)
    pm.on_flush(healthy(1, absmax=50.0), [], [], ORDER)  # type: ignore[arg-type]
    pm.on_exception(RuntimeError("boom"), 1, ORDER)
    report = load_report(pm.reports[0])
    assert report["limits"]["fp16_limit"] == 100.0 and report["limits"]["eps_tol"] == 0.05
    assert report_limits(report).fp16_limit == 100.0
    assert report["exception"]["message"] == "boom"
    html = render_html(report)
    assert "fp16 limit 100" in html and "x / 100)" in html and "256" not in html
    out = io.StringIO()
    Console(file=out, width=120).print(ReportSummary(report))
    row = next(line for line in out.getvalue().splitlines() if ORDER[0] in line)
    assert "2" in row.split()  # fp16_headroom: the limit 100 over max |x| 50


def test_reports_without_limits_read_as_the_defaults() -> None:
    assert report_limits({}).fp16_limit == 256.0
    assert report_limits({"limits": {"fp16_limit": "x", "other": 1}}).fp16_limit == 256.0


def test_an_unwritable_report_dir_is_a_warning_not_a_crash(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    config = WatchConfig.from_options(report_dir=str(blocker / "reports"), report_console=False)
    pm = PostMortem(config)
    with pytest.warns(RuntimeWarning, match="writing the post-mortem failed"):
        verdict = pm.on_exception(ValueError("bad batch"), 4, ORDER)
    assert verdict.trigger == "exception" and pm.reports == []


def test_the_report_says_how_to_replay_the_offending_step(tmp_path: Path) -> None:
    """A plain loop: the fingerprint of step 7's tokens (recomputed here in Python ints),
    and the RNG state its forward began with (taken here, before the call)."""
    import base64

    import torch

    import normwatch
    from normwatch.demos.toymodel import TinyLM, lm_loss, synthetic_batch

    torch.manual_seed(0)
    model = TinyLM(dim=32, depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    w = normwatch.watch(model, opt, flush_every=2, report_dir=str(tmp_path / "r"),
                        report_console=False)
    gen = torch.Generator().manual_seed(0)
    for step in range(1, 10):
        model.blocks[1].mlp.fault = step == 7
        tokens = synthetic_batch(gen, batch=4, seq=16)
        torch.rand(3)  # the loop draws from the global RNG between steps
        if step == 7:
            seen, state = tokens.clone(), torch.get_rng_state()
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        w.step(loss)
    w.finish()
    replay = load_report(w.reports[0])["replay"]
    assert replay["step"] == 7
    flat = seen.flatten().tolist()
    expected = sum(x * (2654435761 * i + 1) for i, x in enumerate(flat)) % (2**31 - 1)
    assert replay["batch_fingerprint"] == f"int64[4x16]:{expected:08x}"
    restored = torch.frombuffer(bytearray(base64.b64decode(replay["rng"]["torch_cpu"])),
                                dtype=torch.uint8)
    assert torch.equal(restored, state)
    assert replay["rng"]["torch_initial_seed"] == str(torch.initial_seed())
    out = io.StringIO()  # what `normwatch report FOLDER` prints
    Console(file=out, width=200).print(ReportSummary(load_report(w.reports[0])))
    assert f"replay step 7: batch int64[4x16]:{expected:08x}, RNG states in report.json" \
        in out.getvalue()
