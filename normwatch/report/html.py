"""A report as one self-contained HTML page: inline CSS and SVG, no scripts, no network.

    >>> html = render_html(load_report(folder))

Verdict and evidence first; then max |x| per layer over steps as a heatmap against the
fp16 limit and as lines against it (the limit ``report.json`` recorded), the loss with
spike and NaN markers, the depth profile of RMS across layers, the hidden-state gradient
by depth, the optimizer's gradient and update norms per step, eps dominance per layer,
the alarms and the environment. Every string taken from the report is HTML-escaped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape
from itertools import pairwise
from typing import Any

from normwatch.judge.grouping import group_alarms
from normwatch.records import Alarm, Limits
from normwatch.report.document import number, report_limits

PLOT_LEFT, PLOT_RIGHT = 190, 160
"""Margins of every plot over steps: their step axes line up on the page."""
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
ol.timeline{margin:6px 0;padding-left:22px} ol.timeline li{margin:2px 0}
"""


def render_html(report: dict[str, Any]) -> str:
    """The whole page (see the module docstring)."""
    layers = report.get("layers") or []
    limit = report_limits(report).fp16_limit
    span = step_span(report)
    band = incident_steps(report)
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
        "<h2>what happened</h2>", timeline(report),
        f"<h2>max |x| per layer over steps (heatmap, x / {limit:g})</h2>",
        heatmap(layers, limit, steps=span),
        "<h2>max |x| per layer against the fp16 limit</h2>",
        absmax_lines(layers, limit, steps=span, band=band),
        "<h2>loss</h2>", loss_chart(report.get("loss_history") or [], report.get("spikes") or [],
                                    steps=span, band=band),
        "<h2>depth profile: RMS across layers (last finite flush)</h2>", depth_profile(layers),
        "<h2>gradient depth profile: hidden-state gradient RMS across layers</h2>",
        gradient_depth(report.get("gradient_depth")),
        "<h2>optimizer steps: gradient and update norms</h2>",
        update_chart(report.get("update_history") or [], steps=span, band=band),
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


TIMELINE = (
    ("fp16_headroom", "first fp16 headroom warning"),
    ("fp16_overflow", "first fp16 overflow"),
    ("eps_dominance", "first eps dominance"),
    ("output_mismatch", "first wrong norm output"),
    ("nonfinite", "first non-finite value"),
)


def events(report: dict[str, Any]) -> list[tuple[int, str, str]]:
    """``(step, what, detail)`` of the run's milestones, in step order: the first alarm of
    each kind that matters (warning or worse; the headroom forecast at any severity), the
    first non-finite loss, the trigger."""
    found: list[tuple[int, str, str]] = []
    alarms = report.get("alarms") or []
    for kind, what in TIMELINE:
        hits = [a for a in alarms if a.get("kind") == kind and isinstance(a.get("step"), int)
                and (kind == "fp16_headroom" or a.get("severity") in ("warning", "critical"))]
        if hits:
            first = min(hits, key=lambda a: a["step"])
            layers = sorted({str(a.get("layer")) for a in hits if a["step"] == first["step"]})
            where = layers[0] if len(layers) == 1 else f"{len(layers)} layers, {layers[0]} …"
            found.append((first["step"], what, where))
    bad = [int(st) for st, v in report.get("loss_history") or []
           if number(v) is None or not math.isfinite(number(v) or 0.0)]
    if bad:
        found.append((min(bad), "loss became non-finite", ""))
    step = report.get("step")
    if isinstance(step, int):
        found.append((step, f"incident opened: {report.get('trigger')}", ""))
    incident = report.get("incident")
    for entry in (incident.get("timeline") or [])[1:] if isinstance(incident, dict) else []:
        if isinstance(entry.get("step"), int):
            found.append((entry["step"], f"joined the incident: {entry.get('trigger')}",
                          str(entry.get("what") or "")))
    return sorted(found, key=lambda e: e[0])


def timeline(report: dict[str, Any]) -> str:
    """The milestones as an ordered list: step, what, where."""
    found = events(report)
    if not found:
        return "<p class='muted'>no events</p>"
    items = "".join(f"<li><b>step {st}</b> · {escape(what)}"
                    + (f" <span class='muted'>({escape(where)})</span>" if where else "")
                    + "</li>" for st, what, where in found)
    return f"<ol class='timeline'>{items}</ol>"


def incident_steps(report: dict[str, Any]) -> tuple[int, int] | None:
    """The first and last step of the report's incident (``None``: none recorded)."""
    incident = report.get("incident")
    if not isinstance(incident, dict):
        return None
    first, last = incident.get("first_step"), incident.get("last_step")
    return (first, last) if isinstance(first, int) and isinstance(last, int) else None


def step_span(report: dict[str, Any]) -> tuple[int, int] | None:
    """The steps every plot over steps shares: from the first to the last step any
    layer history or loss covers (the heatmap's last 120 flushes at most), the incident's
    steps always included."""
    steps = sorted({h["step"] for layer in report.get("layers") or []
                    for h in layer.get("history") or [] if isinstance(h.get("step"), int)})
    losses = [int(st) for st, _ in report.get("loss_history") or []]
    every = steps[-120:] + losses + list(incident_steps(report) or ())
    return (min(every), max(every)) if every else None


def heatmap(layers: Sequence[dict[str, Any]], limit: float = Limits.fp16_limit,
            width: int = 1040, steps: tuple[int, int] | None = None) -> str:
    """Layers (rows, forward order) by flush steps (columns), coloured by max |x| / limit,
    on the step axis ``steps`` shared with the line charts."""
    flushes = sorted({h["step"] for layer in layers for h in layer.get("history", [])})[-120:]
    if not flushes or not layers:
        return "<p class='muted'>no data</p>"
    label_w, row_h, legend_h = PLOT_LEFT, 16, 30
    first, last = steps or (flushes[0], flushes[-1])
    plot_w = width - PLOT_LEFT - PLOT_RIGHT
    per_step = plot_w / max(last - first + 1, 1)
    cell_w = max(2.0, per_step * max(1, _typical_gap(flushes)))
    height = row_h * len(layers) + legend_h + 20
    col = {s: (s - first + 1) * per_step - cell_w for s in flushes}
    out = [_svg_open(width, height)]
    for r, layer in enumerate(layers):
        y = 10 + r * row_h
        out.append(f"<text x='{label_w - 6}' y='{y + 12}' text-anchor='end'>"
                   f"{escape(str(layer.get('name')))}</text>")
        for h in layer.get("history", []):
            if h["step"] not in col:
                continue
            value = number(h.get("absmax"))
            x = label_w + max(0.0, col[h["step"]])
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
    out.append(f"<text x='{label_w}' y='{height - 2}' class='muted'>step {first}</text>"
               f"<text x='{width - PLOT_RIGHT}' y='{height - 2}' text-anchor='end' "
               f"class='muted'>step {last}</text></svg>")
    return "".join(out)


def _typical_gap(steps: Sequence[int]) -> int:
    gaps = sorted(b - a for a, b in pairwise(steps))
    return gaps[len(gaps) // 2] if gaps else 1


def absmax_lines(layers: Sequence[dict[str, Any]], limit: float = Limits.fp16_limit,
                 steps: tuple[int, int] | None = None, band: tuple[int, int] | None = None
                 ) -> str:
    """Max |x| per layer over steps (log scale) with the fp16 limit's line."""
    series = {str(layer.get("name")): [(h["step"], number(h.get("absmax")))
                                       for h in layer.get("history", [])] for layer in layers}
    return line_chart(series, log_y=True, hline=(limit, f"fp16 limit {limit:g}"), x_range=steps,
                      band=band)


def loss_chart(losses: Sequence[Sequence[Any]], spikes: Sequence[dict[str, Any]],
               steps: tuple[int, int] | None = None, band: tuple[int, int] | None = None
               ) -> str:
    """The loss with spike (orange; a run of spikes as one range) and non-finite (red, at
    the top) markers."""
    points = [(int(s), number(v)) for s, v in losses]
    finite: list[tuple[int, float | None]] = [
        (s, v) for s, v in points if v is not None and math.isfinite(v)]
    nonfinite = [s for s, v in points if v is None or not math.isfinite(v)]
    spike_steps = {int(s["step"]) for s in spikes}
    marks = [(s, v, "spike") for s, v in finite if s in spike_steps and v is not None]
    return line_chart({"loss": finite}, markers=marks, top_markers=nonfinite, x_range=steps,
                      band=band)


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


def gradient_depth(depth: dict[str, Any] | None) -> str:
    """The trunk's gradient RMS by depth at the last flush that measured it, with the
    first/last ratio (below 1: it decays toward the input, the Post-Norm signature)."""
    if not depth or not depth.get("points"):
        return "<p class='muted'>no gradients measured (gradients=False, or no full-tier " \
            "step with a backward)</p>"
    points = depth["points"]
    ratio = number(depth.get("ratio"))
    series = {"dL/dh rms": [(i, number(p.get("rms"))) for i, p in enumerate(points)]}
    places = sorted({str(p.get("placement")) for p in points})
    return (f"<div class='muted'>step {escape(str(depth.get('step')))} · first/last ratio "
            f"{_fmt(ratio)} · placement {escape(', '.join(places))}</div>"
            + line_chart(series, log_y=True, x_labels=[str(p.get("layer")) for p in points]))


def update_chart(updates: Sequence[dict[str, Any]], steps: tuple[int, int] | None = None,
                 band: tuple[int, int] | None = None) -> str:
    """Per optimizer step: the global gradient norm and the update norm (log scale)."""
    if not updates:
        return "<p class='muted'>no optimizer attached (normwatch.watch(model, optimizer))</p>"
    return line_chart({name: [(int(u["step"]), number(u.get(name))) for u in updates]
                       for name in ("grad_norm", "update_norm")}, log_y=True, x_range=steps,
                      band=band)


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
    x_range: tuple[int, int] | None = None,
    band: tuple[int, int] | None = None,
    width: int = 1040,
    height: int = 260,
) -> str:
    """A small SVG line chart; non-finite and (for log scale) non-positive values skipped.
    ``x_range``: the step axis shared with the other plots over steps; ``band``: steps to
    shade (the incident's)."""
    clean = {k: [(x, y) for x, y in v if y is not None and math.isfinite(y)
                 and (y > 0 or not log_y)] for k, v in series.items()}
    xs = [x for v in clean.values() for x, _ in v] + list(top_markers)
    ys = [y for v in clean.values() for _, y in v] + ([hline[0]] if hline else [])
    if not xs or not ys:
        return "<p class='muted'>no data</p>"
    left, right, top, bottom = PLOT_LEFT, PLOT_RIGHT, 12, 48 if x_labels else 28
    x0, x1 = (0, max(len(x_labels) - 1, 1)) if x_labels else x_range or (min(xs), max(xs))
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
    for shown in (log_ticks(10**y0, 10**y1, hline[0] if hline else None) if log_y else
                  [y0 + frac * (y1 - y0) for frac in (0.0, 0.5, 1.0)]):
        out.append(f"<line x1='{left}' x2='{width - right}' y1='{py(shown):.1f}' "
                   f"y2='{py(shown):.1f}' stroke='#eee'/><text x='{left - 4}' "
                   f"y='{py(shown) + 4:.1f}' text-anchor='end'>{tick_label(shown)}</text>")
    if not x_labels:
        out += [f"<text x='{left}' y='{height - 8}'>step {x0}</text>",
                f"<text x='{width - right}' y='{height - 8}' text-anchor='end'>step {x1}</text>"]
    else:
        for i, label in enumerate(x_labels):
            out.append(f"<text x='{px(i):.1f}' y='{height - bottom + 14}' text-anchor='middle'"
                       f" font-size='9'>{escape(label[-22:])}</text>")
    if band is not None:  # the incident's steps
        a, b = px(band[0]), px(band[1])
        out.append(f"<rect class='incident' x='{a:.1f}' y='{top}' width='{max(b - a, 2.0):.1f}' "
                   f"height='{height - top - bottom}' fill='#c62828' fill-opacity='0.07'>"
                   f"<title>incident, steps {band[0]}-{band[1]}</title></rect>")
    if hline:  # its label inside the plot, above the line: the legend column stays clear
        y = py(hline[0])
        out.append(f"<line x1='{left}' x2='{width - right}' y1='{y:.1f}' y2='{y:.1f}' "
                   f"stroke='#c62828' stroke-dasharray='6 4'/><text class='hline' "
                   f"x='{width - right - 4}' y='{y - 4:.1f}' text-anchor='end' "
                   f"fill='#c62828'>{escape(hline[1])}</text>")
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
    for run in clusters(markers):  # a run of spikes is one range, marked at its peak
        (first, _, label), (last, _, _) = run[0], run[-1]
        x, y, _ = max(run, key=lambda m: m[1])
        what = f"{escape(label)} at step {x}" if len(run) == 1 else \
            f"{len(run)} {escape(label)}s, steps {first}-{last}"
        if len(run) > 1:
            out.append(f"<rect class='spikes' x='{px(first):.1f}' y='{top}' "
                       f"width='{max(px(last) - px(first), 2.0):.1f}' "
                       f"height='{height - top - bottom}' fill='#ef6c00' fill-opacity='0.12'>"
                       f"<title>{what}</title></rect>")
        out.append(f"<circle cx='{px(x):.1f}' cy='{py(y):.1f}' r='5' fill='none' "
                   f"stroke='#ef6c00' stroke-width='2'><title>{what}</title></circle>")
    for x in top_markers:
        out.append(f"<path d='M{px(x) - 5:.1f},{top + 2} h10 l-5,9 z' fill='#c62828'>"
                   f"<title>non-finite loss at step {x}</title></path>")
    out.append("</svg>")
    return "".join(out)


def clusters(markers: Sequence[tuple[int, float, str]]) -> list[list[tuple[int, float, str]]]:
    """Markers in runs: consecutive ones no further apart than twice the typical gap
    between markers (at least 2 steps) are one run."""
    ordered = sorted(markers)
    if not ordered:
        return []
    gap = max(2, 2 * _typical_gap([m[0] for m in ordered]))
    runs = [[ordered[0]]]
    for m in ordered[1:]:
        if m[0] - runs[-1][-1][0] <= gap:
            runs[-1].append(m)
        else:
            runs.append([m])
    return runs


def log_ticks(lo: float, hi: float, extra: float | None = None) -> list[float]:
    """Ticks of a log axis: the powers of ten in ``[lo, hi]`` (every other one past six),
    and ``extra`` (the fp16 limit) when inside; at least the two ends."""
    powers = [10.0**k for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
              if lo <= 10.0**k <= hi]
    if len(powers) > 6:
        powers = powers[::2]
    ticks = powers + ([extra] if extra is not None and lo <= extra <= hi else [])
    return sorted(set(ticks)) if len(ticks) >= 2 else sorted({lo, hi, *ticks})


def tick_label(value: float) -> str:
    """1, 10, 100, 256, 1e3, 1e4 ... and 0.1, 0.01, 1e-3 below one."""
    if value == 0:
        return "0"
    power = not math.log10(abs(value)) % 1
    if (1 <= abs(value) < 1e4 and not (power and abs(value) >= 1000)) or \
            0.01 <= abs(value) < 1:
        return f"{value:.4g}" if math.log10(abs(value)) % 1 else f"{value:.0f}" \
            if abs(value) >= 1 else f"{value:g}"
    mantissa, exponent = f"{value:.2e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"


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
