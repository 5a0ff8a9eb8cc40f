"""Post-mortem reports: written on the right events, valid JSON, escaped HTML, the CLI,
and the page in a real headless Chromium."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import normwatch
from normwatch.report.document import ReportError, load_report
from normwatch.report.html import render_html

SCRIPT = Path(sys.executable).parent / "normwatch"


def nan_run(report_dir: Path, layer_name: str = "norm") -> normwatch.Watch:
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(8, 8))
    model.add_module(layer_name, nn.LayerNorm(8, eps=0.0))
    w = normwatch.watch(model, flush_every=1, report_dir=str(report_dir), report_console=False)
    for step in range(6):
        x = torch.randn(4, 8)
        if step == 4:
            x = torch.zeros(4, 8)
            model.proj.weight.data.zero_()
            model.proj.bias.data.zero_()
        loss = model(x).pow(2).mean()
        loss.backward()
        w.step(loss)
    return w


def test_report_written_on_first_nonfinite_with_the_documented_schema(tmp_path: Path) -> None:
    w = nan_run(tmp_path / "reports")
    assert len(w.reports) == 1  # the NaN loss of the same episode adds no second report
    folder = w.reports[0]
    assert folder.parent == tmp_path / "reports" and "step5-nonfinite_activation" in folder.name
    assert {p.name for p in folder.iterdir()} == {"report.json", "report.html"}
    raw = (folder / "report.json").read_text()
    json.loads(raw, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    report = load_report(folder)
    assert (report["schema"], report["version"], report["trigger"], report["step"]) == (
        "normwatch.report", 1, "nonfinite_activation", 5)
    assert report["verdict"]["blame"] == "normalization"
    assert report["verdict"]["layer"] == "norm"
    assert report["first_nonfinite"] == {"step": 5, "layer": "norm", "position": 0,
                                         "origin": "norm"}
    layer = report["layers"][0]
    assert layer["name"] == "norm"
    assert [h["step"] for h in layer["history"]] == [1, 2, 3, 4, 5]  # up to the event
    assert layer["history"][4]["out_nonfinite"] == 4  # tokens holding NaN/inf
    assert report["loss_history"][4] == [5, "nan"]
    assert {a["kind"] for a in report["alarms"]} >= {"nonfinite", "eps_dominance"}
    env = report["environment"]
    assert env["torch"] == torch.__version__ and env["dtypes"]["input"] == ["float32"]
    assert report["exception"] is None


def test_html_escapes_everything_from_the_model(tmp_path: Path) -> None:
    evil = "<script>alert(1)</script>"
    w = nan_run(tmp_path, layer_name=evil)
    html = (w.reports[0] / "report.html").read_text()
    assert evil not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<script" not in html.lower()  # no scripts of our own either
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")  # no network


def test_exception_in_a_with_block_writes_a_report(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.RMSNorm(4))
    with pytest.raises(RuntimeError, match="dataloader died"), \
            normwatch.watch(model, report_dir=str(tmp_path), report_console=False) as w:
        model(torch.randn(2, 4)).sum().backward()
        w.step()
        raise RuntimeError("dataloader died")
    report = load_report(w.reports[0])
    assert report["trigger"] == "exception"
    assert report["exception"]["type"] == "RuntimeError"
    assert "dataloader died" in report["exception"]["traceback"]
    assert report["verdict"]["blame"] == "not_normalization"


def test_no_reports_when_disabled_and_healthy_runs_write_none(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    w = normwatch.watch(model, flush_every=1, report_dir=None)
    model(torch.full((2, 4), float("nan"))).sum().backward()
    w.step()
    assert w.verdicts and w.reports == []


@pytest.mark.parametrize("content,message", [
    (None, "no normwatch report at"),
    ("{not json", "is not valid JSON: Expecting property name enclosed in double quotes at "
                  "line 1, column 2"),
    ('{"schema": "other"}', "is not a normwatch report: 'schema' must be 'normwatch.report'"),
    ('{"schema": "normwatch.report", "version": 99}', "unsupported report version 99"),
    ('{"schema": "normwatch.report", "version": 1}', "missing fields verdict, layers"),
])
def test_bad_report_paths(tmp_path: Path, content: str | None, message: str) -> None:
    folder = tmp_path / "r"
    if content is not None:
        folder.mkdir()
        (folder / "report.json").write_text(content)
    with pytest.raises(ReportError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_report(folder)
    result = subprocess.run([str(SCRIPT), "report", str(folder)], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 2 and message in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_rerenders_a_report(tmp_path: Path) -> None:
    folder = nan_run(tmp_path / "reports").reports[0]
    out = tmp_path / "again.html"
    result = subprocess.run([str(SCRIPT), "report", str(folder), "--html", str(out)],
                            capture_output=True, text=True, check=False,
                            env={**os.environ, "COLUMNS": "120"})
    assert result.returncode == 0, result.stderr
    assert "nonfinite_activation at step 5" in result.stdout
    assert "blame: NORMALIZATION · layer norm · cause eps_dominance" in result.stdout
    assert out.read_text() == render_html(load_report(folder))


def find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(find_chromium() is None, reason="chromium not installed (scripts/test "
                    "installs it)")
def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:

    from PIL import Image, ImageStat
    from rich.console import Console

    from normwatch.demos.demo import run_demo

    result = run_demo("fp16-overflow", console=Console(file=io.StringIO()), live=False,
                      report_dir=str(tmp_path / "reports"))
    page = result.reports[-1] / "report.html"
    shot = tmp_path / "shot.png"
    subprocess.run([
        str(find_chromium()), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,1600",
        f"--screenshot={shot}", page.as_uri(),
    ], capture_output=True, timeout=120, check=True)
    image = Image.open(shot).convert("RGB")
    assert image.size == (1200, 1600)
    stat = ImageStat.Stat(image)
    assert max(stat.stddev) > 20  # not blank: text, charts and colour
    colours = image.getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 50
    red = sum(1 for r, g, b in image.get_flattened_data() if r > 150 and g < 60 and b < 60)
    assert red > 1000  # the heatmap's past-256 cells and the verdict bar are red
    # the page as the browser parsed it: the timeline in order, one alarm row per group
    dom = subprocess.run([
        str(find_chromium()), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri(),
    ], capture_output=True, text=True, timeout=120, check=True).stdout
    timeline = dom.split("<ol class=\"timeline\">", 1)[1].split("</ol>", 1)[0]
    order = [timeline.index(s) for s in ("first fp16 headroom warning", "first fp16 overflow",
                                         "first non-finite value", "loss became non-finite")]
    assert order == sorted(order)
    assert dom.index("what happened") < dom.index("max |x| per layer over steps")
    rows = dom.split("<h2>alarms</h2>", 1)[1].split("<h2>environment</h2>", 1)[0]
    assert "<details><summary>5 layers, blocks.0.norm1 … norm</summary>" in rows
    groups = rows.count("<tr class=\"crit\"><td>") + rows.count("<tr class=\"warn\"><td>")
    assert 0 < groups < len([a for a in result.alarms if a.severity != "info"])


def test_plots_over_steps_share_one_axis_and_log_ticks_read_plainly() -> None:
    from normwatch.report.html import PLOT_LEFT, heatmap, line_chart, log_ticks, tick_label

    layers = [{"name": "a", "history": [{"step": s, "absmax": 2.0 * s} for s in (10, 20, 30)]}]
    span = (1, 40)  # the loss starts before the first flush: every plot starts at step 1
    heat = heatmap(layers, 256.0, steps=span)
    chart = line_chart({"a": [(10, 20.0), (30, 60.0)]}, log_y=True, hline=(256.0, "limit"),
                       x_range=span)
    assert "step 1<" in heat and "step 40<" in heat and ">step 1<" in chart
    assert f"<rect x='{PLOT_LEFT}'" in chart  # the plot area starts where the heatmap's does
    assert [tick_label(t) for t in log_ticks(0.5, 3e4, 256.0)] == \
        ["1", "10", "100", "256", "1e3", "1e4"]
    assert [tick_label(v) for v in (1e-3, 0.05, 1.5e5, 9050.0)] == ["1e-3", "0.05", "1.5e5",
                                                                     "9050"]


def test_html_at_a_glance_label_clear_of_the_legend_spikes_as_ranges_incident_shaded() -> None:
    """The fp16 limit's label sat on the first legend entry; 25 consecutive spikes drew 25
    circles; the incident's steps were not marked."""
    import re

    from normwatch.report.html import PLOT_RIGHT, line_chart, loss_chart

    width = 1040
    chart = line_chart({"blocks.0.norm": [(s, 2.0 * s) for s in range(1, 50)],
                        "blocks.1.norm": [(s, 3.0 * s) for s in range(1, 50)]},
                       log_y=True, hline=(256.0, "fp16 limit 256"), width=width)
    label = re.search(r"<text class='hline' x='([\d.]+)' y='([\d.]+)' text-anchor='end'", chart)
    assert label is not None and float(label.group(1)) <= width - PLOT_RIGHT  # inside the plot
    legend_x = [float(x) for x in re.findall(r"<text x='([\d.]+)' y='[\d.]+' fill='#", chart)]
    assert legend_x and min(legend_x) > width - PLOT_RIGHT  # the legend's column, to its right
    losses = [[s, 2.0 + (6.0 if 40 <= s < 65 else 0.0) + 0.01 * (s % 3)] for s in range(100)]
    spikes = [{"step": s} for s in (*range(40, 65), 90)]
    svg = loss_chart(losses, spikes, band=(40, 95))
    assert svg.count("<circle") == 2  # one run of 25, one lone spike
    assert svg.count("class='spikes'") == 1 and "25 spikes, steps 40-64" in svg
    assert "spike at step 90" in svg
    assert svg.count("class='incident'") == 1 and "incident, steps 40-95" in svg
