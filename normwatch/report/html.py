"""A report as one self-contained HTML page: inline CSS and SVG, no scripts, no network.

    >>> html = render_html(load_report(folder))

Verdict and evidence first; then max |x| per layer over steps as a heatmap against the
fp16 limit and as lines against it (the limit ``report.json`` recorded), the loss with
spike and NaN markers, the depth profile of RMS across layers, eps dominance per layer,
the alarms and the environment. Every string taken from the report is HTML-escaped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape
from typing import Any

from normwatch.records import Alarm, Limits
from normwatch.report.document import number, report_limits
from normwatch.report.grouping import group_alarms

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")
BLAME_COLOURS = {"normalization": "#c62828", "not_normalization": "#2e7d32",
                 "inconclusive": "#ef6c00"}
CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1100px;color:#222}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.verdict{border-left:6px solid var(--c);background:#fafafa;padding:10px 16px;margin:12px 0}
.blame{color:var(--c);font-weight:700;text-transform:uppercase}
table{border-collapse:collapse;font-size:12px} td,th{border:1px solid #ddd;padding:3px 6px;
text-align:left;vertical-align:top} .crit{color:#c62828;font-weight:600} .warn{color:#ef6c00}
svg text{font:11px system-ui,sans-serif} .muted{color:#777}
"""


def render_html(report: dict[str, Any]) -> str:
    """The whole page (see the module docstring)."""
    layers = report.get("layers") or []
    limit = report_limits(report).fp16_limit
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width,initial-scale=1'>",
        f"<title>normwatch report · step {escape(str(report.get('step')))}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>normwatch post-mortem · {escape(str(report.get('trigger')))} at step "
        f"{escape(str(report.get('step')))}</h1>",
        f"<div class='muted'>created {escape(str(report.get('created')))}"
        + (f" · rank {escape(str(report['rank']))}" if report.get("rank") is not None else "")
        + "</div>",
        _verdict(report.get("verdict"), report.get("first_nonfinite")),
        f"<h2>max |x| per layer over steps (heatmap, x / {limit:g})</h2>",
        heatmap(layers, limit),
        "<h2>max |x| per layer against the fp16 limit</h2>", absmax_lines(layers, limit),
        "<h2>loss</h2>", loss_chart(report.get("loss_history") or [], report.get("spikes") or []),
        "<h2>depth profile: RMS across layers (last finite flush)</h2>", depth_profile(layers),
        "<h2>eps dominance per layer (max eps / (s + eps))</h2>", eps_bars(layers),
        "<h2>alarms</h2>", _alarms(report.get("alarms") or []),
        "<h2>environment</h2>", _environment(report.get("environment") or {}),
    ]
    exc = report.get("exception")
    if exc:
        parts += ["<h2>exception</h2>", f"<pre>{escape(str(exc.get('traceback', '')))}</pre>"]
    parts.append("</body></html>")
    return "\n".join(parts)


def _verdict(verdict: dict[str, Any] | None, first: dict[str, Any] | None) -> str:
    if not verdict:
        return "<div class='verdict' style='--c:#777'>No verdict.</div>"
    colour = BLAME_COLOURS.get(str(verdict.get("blame")), "#777")
    rows = [
        f"<div class='verdict' style='--c:{colour}'>",
        f"<div>Blame: <span class='blame'>{escape(str(verdict.get('blame')))}</span>",
    ]
    if verdict.get("layer"):
        rows.append(f" · layer <b>{escape(str(verdict['layer']))}</b>")
    if verdict.get("cause"):
        rows.append(f" · cause <b>{escape(str(verdict['cause']))}</b>")
    rows.append("</div>")
    if verdict.get("block"):
        rows.append(f"<div>Produced {escape(str(verdict['block']))}</div>")
    rows.append("<ul>" + "".join(f"<li>{escape(str(e))}</li>"
                                 for e in verdict.get("evidence") or []) + "</ul>")
    if first:
        rows.append(f"<div class='muted'>first non-finite: step {escape(str(first.get('step')))}"
                    f", layer {escape(str(first.get('layer')))}, "
                    f"{'born in the norm' if first.get('origin') == 'norm' else 'arrived'}"
                    "</div>")
    rows.append("</div>")
    return "".join(rows)


def heatmap(layers: Sequence[dict[str, Any]], limit: float = Limits.fp16_limit,
            width: int = 1040) -> str:
    """Layers (rows, forward order) by flush steps (columns), coloured by max |x| / limit."""
    steps = sorted({h["step"] for layer in layers for h in layer.get("history", [])})[-120:]
    if not steps or not layers:
        return "<p class='muted'>no data</p>"
    label_w, row_h, legend_h = 190, 16, 30
    cell_w = max(2.0, (width - label_w - 10) / len(steps))
    height = row_h * len(layers) + legend_h + 20
    col = {s: i for i, s in enumerate(steps)}
    out = [_svg_open(width, height)]
    for r, layer in enumerate(layers):
        y = 10 + r * row_h
        out.append(f"<text x='{label_w - 6}' y='{y + 12}' text-anchor='end'>"
                   f"{escape(str(layer.get('name')))}</text>")
        for h in layer.get("history", []):
            if h["step"] not in col:
                continue
            value = number(h.get("absmax"))
            x = label_w + col[h["step"]] * cell_w
            out.append(f"<rect x='{x:.1f}' y='{y}' width='{cell_w + 0.3:.1f}' "
                       f"height='{row_h - 1}' fill='{_heat(value, limit)}'><title>"
                       f"{escape(str(layer.get('name')))} step {h['step']}: "
                       f"max |x| = {_fmt(value)}</title></rect>")
    y = 20 + row_h * len(layers)
    legend = ((0.01, f"≤ {0.01 * limit:.3g}"), (0.1, f"{0.1 * limit:.3g}"),
              (0.5, f"{0.5 * limit:.3g}"), (1.0, f"{limit:g} limit"), (4.0, f"> {limit:g}"))
    for i, (ratio, text) in enumerate(legend):
        x = label_w + i * 110
        out.append(f"<rect x='{x}' y='{y}' width='14' height='12' "
                   f"fill='{_heat(ratio * limit, limit)}'/>"
                   f"<text x='{x + 18}' y='{y + 10}'>{text}</text>")
    out.append(f"<text x='{steps and label_w}' y='{height - 2}' class='muted'>steps "
               f"{steps[0]}–{steps[-1]}</text></svg>")
    return "".join(out)


def absmax_lines(layers: Sequence[dict[str, Any]], limit: float = Limits.fp16_limit) -> str:
    """Max |x| per layer over steps (log scale) with the fp16 limit's line."""
    series = {str(layer.get("name")): [(h["step"], number(h.get("absmax")))
                                       for h in layer.get("history", [])] for layer in layers}
    return line_chart(series, log_y=True, hline=(limit, f"fp16 limit {limit:g}"))


def loss_chart(losses: Sequence[Sequence[Any]], spikes: Sequence[dict[str, Any]]) -> str:
    """The loss with spike (orange) and non-finite (red, at the top) markers."""
    points = [(int(s), number(v)) for s, v in losses]
    finite: list[tuple[int, float | None]] = [
        (s, v) for s, v in points if v is not None and math.isfinite(v)]
    nonfinite = [s for s, v in points if v is None or not math.isfinite(v)]
    spike_steps = {int(s["step"]) for s in spikes}
    marks = [(s, v, "spike") for s, v in finite if s in spike_steps and v is not None]
    return line_chart({"loss": finite}, markers=marks, top_markers=nonfinite)


def depth_profile(layers: Sequence[dict[str, Any]]) -> str:
    """RMS mean and max across layers in forward order, from each layer's last flush that
    still had finite tokens."""
    names: list[str] = []
    mean: list[tuple[int, float | None]] = []
    peak: list[tuple[int, float | None]] = []
    for layer in layers:
        rows = [h for h in layer.get("history") or [] if number(h.get("rms_mean")) is not None]
        if rows:
            mean.append((len(names), number(rows[-1].get("rms_mean"))))
            peak.append((len(names), number(rows[-1].get("rms_max"))))
            names.append(str(layer.get("name")))
    return line_chart({"rms mean": mean, "rms max": peak}, log_y=True, x_labels=names)


def eps_bars(layers: Sequence[dict[str, Any]], width: int = 1040) -> str:
    """Worst eps/(s+eps) per layer over the report's history, log scale 1e-12 to 1."""
    rows = []
    for layer in layers:
        values = [number(h.get("eps_dominance")) for h in layer.get("history") or []]
        finite = [v for v in values if v is not None and math.isfinite(v)]
        rows.append((str(layer.get("name")), max(finite) if finite else None))
    if not rows:
        return "<p class='muted'>no data</p>"
    label_w, bar_h = 190, 16
    out = [_svg_open(width, bar_h * len(rows) + 24)]
    span = width - label_w - 80
    for i, (name, value) in enumerate(rows):
        y = 4 + i * bar_h
        frac = 0.0 if not value else min(1.0, max(0.0, (math.log10(value) + 12) / 12))
        level = value or 0.0
        colour = "#c62828" if level > 0.1 else "#ef6c00" if level > 0.01 else "#90a4ae"
        out.append(f"<text x='{label_w - 6}' y='{y + 12}' text-anchor='end'>{escape(name)}</text>"
                   f"<rect x='{label_w}' y='{y}' width='{frac * span:.1f}' height='{bar_h - 3}'"
                   f" fill='{colour}'/><text x='{label_w + frac * span + 4:.1f}' y='{y + 12}'>"
                   f"{_fmt(value)}</text>")
    tol_x = label_w + (math.log10(0.01) + 12) / 12 * span
    out.append(f"<line x1='{tol_x:.1f}' x2='{tol_x:.1f}' y1='0' y2='{bar_h * len(rows) + 4}' "
               "stroke='#c62828' stroke-dasharray='4 3'/>"
               f"<text x='{tol_x + 3:.1f}' y='{bar_h * len(rows) + 18}'>eps_tol 0.01</text></svg>")
    return "".join(out)


def line_chart(
    series: dict[str, list[tuple[int, float | None]]],
    *,
    log_y: bool = False,
    hline: tuple[float, str] | None = None,
    markers: Sequence[tuple[int, float, str]] = (),
    top_markers: Sequence[int] = (),
    x_labels: Sequence[str] | None = None,
    width: int = 1040,
    height: int = 260,
) -> str:
    """A small SVG line chart; non-finite and (for log scale) non-positive values skipped."""
    clean = {k: [(x, y) for x, y in v if y is not None and math.isfinite(y)
                 and (y > 0 or not log_y)] for k, v in series.items()}
    xs = [x for v in clean.values() for x, _ in v] + list(top_markers)
    ys = [y for v in clean.values() for _, y in v] + ([hline[0]] if hline else [])
    if not xs or not ys:
        return "<p class='muted'>no data</p>"
    left, right, top, bottom = 60, 160, 12, 48 if x_labels else 28
    x0, x1 = (0, max(len(x_labels) - 1, 1)) if x_labels else (min(xs), max(xs))
    tf = (lambda v: math.log10(v)) if log_y else (lambda v: v)
    y0, y1 = tf(min(ys)), tf(max(ys))
    if y1 - y0 < 1e-12:
        y0, y1 = y0 - 1, y1 + 1
    pad = (y1 - y0) * 0.06
    y0, y1 = y0 - pad, y1 + pad

    def px(x: float) -> float:
        return left + (x - x0) / ((x1 - x0) or 1) * (width - left - right)

    def py(y: float) -> float:
        return top + (1 - (tf(y) - y0) / (y1 - y0)) * (height - top - bottom)

    out = [_svg_open(width, height),
           f"<rect x='{left}' y='{top}' width='{width - left - right}' "
           f"height='{height - top - bottom}' fill='none' stroke='#ccc'/>"]
    for frac in (0.0, 0.5, 1.0):
        value = y0 + frac * (y1 - y0)
        shown = 10**value if log_y else value
        out.append(f"<text x='{left - 4}' y='{py(shown) + 4:.1f}' text-anchor='end'>"
                   f"{_fmt(shown)}</text>")
    if not x_labels:
        out += [f"<text x='{left}' y='{height - 8}'>step {x0}</text>",
                f"<text x='{width - right}' y='{height - 8}' text-anchor='end'>step {x1}</text>"]
    else:
        for i, label in enumerate(x_labels):
            out.append(f"<text x='{px(i):.1f}' y='{height - bottom + 14}' text-anchor='middle'"
                       f" font-size='9'>{escape(label[-22:])}</text>")
    if hline:
        y = py(hline[0])
        out.append(f"<line x1='{left}' x2='{width - right}' y1='{y:.1f}' y2='{y:.1f}' "
                   f"stroke='#c62828' stroke-dasharray='6 4'/><text x='{width - right + 4}' "
                   f"y='{y + 4:.1f}' fill='#c62828'>{escape(hline[1])}</text>")
    for i, (name, points) in enumerate(clean.items()):
        colour = PALETTE[i % len(PALETTE)]
        if points:
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
            out.append(f"<polyline points='{path}' fill='none' stroke='{colour}' "
                       f"stroke-width='1.5'/>")
            if len(points) == 1 or x_labels:
                out += [f"<circle cx='{px(x):.1f}' cy='{py(y):.1f}' r='2.5' fill='{colour}'/>"
                        for x, y in points]
        out.append(f"<text x='{width - right + 8}' y='{top + 14 + 14 * (i % 16)}' "
                   f"fill='{colour}'>{escape(name[-24:])}</text>")
    for x, y, label in markers:
        out.append(f"<circle cx='{px(x):.1f}' cy='{py(y):.1f}' r='5' fill='none' "
                   f"stroke='#ef6c00' stroke-width='2'><title>{escape(label)} at step {x}"
                   "</title></circle>")
    for x in top_markers:
        out.append(f"<path d='M{px(x) - 5:.1f},{top + 2} h10 l-5,9 z' fill='#c62828'>"
                   f"<title>non-finite loss at step {x}</title></path>")
    out.append("</svg>")
    return "".join(out)


def _alarms(alarms: Sequence[dict[str, Any]]) -> str:
    """The alarm table, one row per kind and severity per step (as the console prints
    them); a group's per-layer alarms fold out of its row."""
    if not alarms:
        return "<p class='muted'>none</p>"
    rows = ["<table><tr><th>step</th><th>severity</th><th>kind</th><th>layer</th>"
            "<th>count</th><th>message</th></tr>"]
    by_step: dict[int, list[Alarm]] = {}
    for a in alarms[-500:]:
        alarm = _record(a)
        by_step.setdefault(alarm.step, []).append(alarm)
    for step in sorted(by_step):
        for group in group_alarms(by_step[step]):
            cls = {"critical": "crit", "warning": "warn"}.get(group.severity, "")
            count = sum(a.count for a in group.alarms)
            if len(group.alarms) == 1:
                where = escape(str(group.alarms[0].layer))
            else:
                detail = "".join(
                    f"<tr><td>{escape(str(a.layer))}</td><td>{escape(f'{a.value:.4g}')}</td>"
                    f"<td>{a.count}</td><td>{escape(a.message)}</td></tr>"
                    for a in group.alarms)
                where = (f"<details><summary>{escape(group.where())}</summary><table class="
                         f"'detail'><tr><th>layer</th><th>value</th><th>count</th><th>message"
                         f"</th></tr>{detail}</table></details>")
            rows.append(f"<tr class='{cls}'><td>{step}</td><td>{escape(group.severity)}</td>"
                        f"<td>{escape(group.kind)}</td><td>{where}</td><td>{count}</td>"
                        f"<td>{escape(group.text())}</td></tr>")
    return "".join(rows) + "</table>"


def _record(a: dict[str, Any]) -> Alarm:
    """An alarm of ``report.json`` as a record (missing fields get neutral values)."""
    value, threshold = number(a.get("value")), number(a.get("threshold"))
    step = a.get("step")
    count = a.get("count")
    return Alarm(kind=str(a.get("kind")), severity=str(a.get("severity")),  # type: ignore[arg-type]
                 layer=None if a.get("layer") is None else str(a.get("layer")),
                 step=step if isinstance(step, int) else 0,
                 value=math.nan if value is None else value,
                 threshold=math.nan if threshold is None else threshold,
                 message=str(a.get("message")), count=count if isinstance(count, int) else 1)


def _environment(env: dict[str, Any]) -> str:
    rows = "".join(f"<tr><th>{escape(str(k))}</th><td>{escape(str(v))}</td></tr>"
                   for k, v in env.items())
    return f"<table>{rows}</table>"


def _svg_open(width: int, height: float) -> str:
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height:.0f}' "
            f"viewBox='0 0 {width} {height:.0f}' role='img'>")


def _heat(value: float | None, limit: float) -> str:
    if value is None or not math.isfinite(value):
        return "#000000"
    ratio = value / limit
    if ratio > 1:
        return "#b71c1c"
    t = min(1.0, max(0.0, (math.log10(max(ratio, 1e-3)) + 3) / 3))  # 1e-3 .. 1
    r, g, b = int(230 + 25 * t), int(245 - 150 * t), int(230 - 200 * t)
    return f"#{r:02x}{g:02x}{b:02x}"


def _fmt(value: float | None) -> str:
    if value is None:
        return "–"
    if value != value or math.isinf(value):
        return str(value)
    if value == 0:
        return "0"
    return f"{value:.3g}" if 1e-3 <= abs(value) < 1e5 else f"{value:.1e}"
