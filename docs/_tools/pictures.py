"""The README's and the site's pictures, made from a real run of the demo's fp16 drill.

    python docs/_tools/pictures.py [OUT]      # default docs/images; scripts/pictures runs it

- ``console.svg``: the live console's panel at the flush of the first critical alarm;
- ``report.png``: the post-mortem's HTML page, as a headless Chromium renders it (left
  out, with a note, where no Chromium is installed);
- ``grafana-panels.svg``: each Grafana panel's data over the run, from the watch's own
  Prometheus collector after each flush, evaluated with the panel's query.
"""

from __future__ import annotations

import io
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards" / "grafana" / "normwatch.json"
Series = dict[str, list[tuple[int, float | None]]]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class Recorder:
    """A watch sink that keeps every flush."""

    def __init__(self) -> None:
        self.flushes: list = []  # type: ignore[type-arg]

    def on_flush(self, flush: object) -> None:
        self.flushes.append(flush)

    def on_exception(self, flush: object, exc: BaseException) -> None:
        pass

    def close(self) -> None:
        pass


def console_svg(flushes: list, out: Path) -> None:  # type: ignore[type-arg]
    """The live panel as it stood at the flush of the first critical alarm."""
    from normwatch.report.live import LivePanel, LiveState

    lines = []
    for flush in flushes:
        lines += list(flush.lines)
        if any(a.severity == "critical" for a in flush.lines):
            break
    state = LiveState(flush.snapshot, flush.health, flush.limits.fp16_limit,
                      dict(flush.trends), lines[-5:])
    console = Console(record=True, width=118, file=io.StringIO(), force_terminal=True,
                      color_system="truecolor")
    console.print(LivePanel(state, height=24))
    out.write_text(console.export_svg(title="normwatch demo · fp16-overflow"), encoding="utf-8")


def report_png(report_html: Path, out: Path) -> bool:
    """The HTML post-mortem's first screen; False where no Chromium is found."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or \
        shutil.which("google-chrome")
    if browser is None:
        return False
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                        "--hide-scrollbars", f"--user-data-dir={profile}",
                        "--window-size=1180,1500", f"--screenshot={out}",
                        report_html.as_uri()], check=True, capture_output=True, timeout=120)
    return out.exists()


def scrapes(flushes: list, layers: tuple) -> list[tuple[int, Samples]]:  # type: ignore[type-arg]
    """What a scrape after each flush returns: the watch's collector, fed flush by flush."""
    from normwatch._version import __version__
    from normwatch.export.prometheus import NormwatchCollector

    collector = NormwatchCollector(layers, "demo", None, flushes[0].limits, __version__)
    out = []
    for flush in flushes:
        collector.on_flush(flush)
        samples: Samples = {}
        for family in collector.collect():
            for s in family.samples:
                samples[(s.name, frozenset(s.labels.items()))] = s.value
        out.append((flush.snapshot.step, samples))
    return out


QUERY = re.compile(
    r"^(?:(?P<agg>sum|min|max)(?: by \((?P<by>[^)]*)\))? ?\()?"
    r"(?:(?P<fn>rate|increase)\()?(?P<metric>normwatch_\w+)\{(?P<match>[^}]*)\}"
    r"(?:\[[^\]]*\])?\)?\)?(?P<rest>.*)$")


def _matches(labels: frozenset[tuple[str, str]], match: str) -> bool:
    for name, op, value in re.findall(r'(\w+)\s*(=~|=)\s*"([^"]*)"', match):
        if "$" in value:
            continue  # a dashboard variable: every value
        got = dict(labels).get(name)
        if got is None or not (re.fullmatch(value, got) if op == "=~" else got == value):
            return False
    return True


def evaluate(expr: str, runs: list[tuple[int, Samples]]) -> Series:
    """The panel query over the run: gauges as they were, counters' ``rate``/``increase``
    as their increase per flush, ``sum``/``min``/``max`` (``by``) across series, a
    ``/ scalar(max(...))`` divisor. ``time() - ...`` (wall clock) gives no series."""
    if expr.startswith("time()"):
        return {}
    m = QUERY.match(expr)
    if m is None:
        raise ValueError(f"a query this tool cannot read: {expr}")
    metric, match = m["metric"], m["match"]
    divisor = None
    if m["rest"].strip():
        d = re.match(r"\s*/\s*scalar\((?:max\()?(normwatch_\w+)\{([^}]*)\}\)?\)", m["rest"])
        if d is None:
            raise ValueError(f"a query this tool cannot read: {expr}")
        divisor = d.groups()
    name = metric + ("_total" if m["fn"] and not metric.endswith("_total") else "")
    raw: dict[frozenset[tuple[str, str]], list[tuple[int, float]]] = defaultdict(list)
    previous: dict[frozenset[tuple[str, str]], float] = {}
    for step, samples in runs:
        for (sample, labels), value in samples.items():
            if sample != name or not _matches(labels, match):
                continue
            if m["fn"]:
                value, previous[labels] = value - previous.get(labels, 0.0), value
            if divisor is not None:
                limit = max(v for (n, lab), v in samples.items() if n == divisor[0])
                value = value / limit
            raw[labels].append((step, value))
    short = metric.removeprefix("normwatch_").removeprefix("layer_").removesuffix("_total")
    by = [b.strip() for b in (m["by"] or "").split(",") if b.strip()]
    if m["agg"] is None:
        out = {}
        for labels, points in raw.items():
            keep = ("layer", "where") if "layer" in dict(labels) else ("blame", "kind",
                                                                       "severity")
            out[_label(labels, keep) or short] = points
        return _moving(out)
    groups: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for labels, points in raw.items():
        for step, value in points:
            key = " ".join(f"{k} {v}" for k, v in sorted(labels) if k in by)
            groups[key or f"{m['agg']}({short})"][step].append(value)
    fold = {"sum": sum, "min": min, "max": max}[m["agg"]]
    return _moving({key: sorted((step, fold(values)) for step, values in by_step.items())
                    for key, by_step in groups.items()})


def _moving(series: Series) -> Series:
    """Series that are not zero throughout (an alarm kind that never fired says nothing)."""
    return {k: v for k, v in series.items() if any(y for _, y in v)} or series


def _label(labels: frozenset[tuple[str, str]], keys: tuple[str, ...] | list[str]) -> str:
    found = dict(labels)
    return " ".join(found[k] for k in keys if k in found)


def panels_svg(runs: list[tuple[int, Samples]], out: Path) -> list[str]:
    """Every panel of the dashboard, each its data over the run; returns the titles."""
    from normwatch.report.html import line_chart

    panels = json.loads(DASHBOARD.read_text())["panels"]
    width, height, columns = 560, 230, 2
    cells, titles = [], []
    for i, panel in enumerate(panels):
        series: Series = {}
        for target in panel.get("targets", []):
            series.update(evaluate(target["expr"], runs))
        x, y = (i % columns) * width, (i // columns) * (height + 24)
        title = panel["title"]
        titles.append(title)
        scale = panel.get("fieldConfig", {}).get("defaults", {}).get("custom", {}).get(
            "scaleDistribution") or {}
        chart = line_chart(series, width=width - 10, height=height,
                           log_y=scale.get("type") == "log") if series else ""
        if chart.startswith("<svg"):
            chart = chart.replace("<svg ", f"<svg x='{x}' y='{y + 20}' ", 1)
        else:  # no series (a wall-clock panel): its caption only
            chart = (f"<text x='{x + 60}' y='{y + 120}' fill='#777'>time() − the last flush: "
                     "seconds, not a series over steps</text>")
        cells.append(f"<text x='{x + 8}' y='{y + 14}' font-weight='bold'>"
                     f"{_escape(title)} · {panel['type']}</text>{chart}")
    rows = math.ceil(len(panels) / columns)
    total = (width * columns, rows * (height + 24))
    out.write_text(
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{total[0]}' height='{total[1]}' "
        f"viewBox='0 0 {total[0]} {total[1]}'><style>text{{font:11px sans-serif}}</style>"
        f"<rect width='100%' height='100%' fill='white'/>{''.join(cells)}</svg>",
        encoding="utf-8")
    return titles


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def main(out: Path) -> dict[str, object]:
    """Run the drill and write the pictures into ``out``; what was made."""
    from normwatch.demos.demo import run_demo

    out.mkdir(parents=True, exist_ok=True)
    recorder = Recorder()
    with tempfile.TemporaryDirectory() as reports:
        result = run_demo("fp16-overflow", console=Console(file=io.StringIO(), width=120),
                          live=False, report_dir=reports, device="cpu", sinks=[recorder])
        console_svg(recorder.flushes, out / "console.svg")
        made = {"console": out / "console.svg", "steps": result.steps_run}
        if report_png(result.reports[0] / "report.html", out / "report.png"):
            made["report"] = out / "report.png"
        else:
            print("no Chromium found: report.png left as it was", file=sys.stderr)
    made["panels"] = panels_svg(scrapes(recorder.flushes, result.layers),
                                out / "grafana-panels.svg")
    return made


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "images"
    for key, value in main(target).items():
        print(f"{key}: {value}")
