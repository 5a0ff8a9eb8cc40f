"""Rich renderables: the per-layer health table and alarm lines.

    >>> from rich.console import Console
    >>> Console().print(HealthTable(snapshot, findings))

Worst layers first, coloured by severity; the text still reads in a plain CI log
(status words, not only colours; ASCII-safe box).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from normwatch.records import SEVERITY_RANK, Alarm, LayerStats, Limits, Snapshot
from normwatch.report.document import number, report_limits

STYLES = {"ok": "green", "info": "cyan", "warning": "yellow", "critical": "bold red"}
LABELS = {"ok": "OK", "info": "INFO", "warning": "WARN", "critical": "CRIT"}


LEGEND = ("columns are the logged statistics' names · absmax: max |x| · fp16_headroom: "
          "fp16 limit / absmax (below 1: overflow) · rms_mean, rms_max: per-token RMS · "
          "eps_dominance: max eps/(s+eps) · common_mode_max: max |mean|/RMS · nonfinite: "
          "tokens holding NaN/inf, input/output · grad_hidden_rms: RMS of dL/dx, the hidden "
          "state's gradient at the norm's input · dtype: input>weight>output")


def stderr_console() -> Console:
    """stderr as a console: a terminal as it is; anything else (a log file, a pipe, CI)
    gets lines that are never wrapped and ``COLUMNS`` (default 160) columns for tables."""
    console = Console(stderr=True)
    if console.is_terminal:
        return console
    return Console(stderr=True, soft_wrap=True,
                   width=int(os.environ.get("COLUMNS", "0") or 0) or 160)


def header(name: str) -> str:
    """A statistic's name as a column header, broken after its first ``_`` if long."""
    return name.replace("_", "_\n", 1) if len(name) > 6 else name


def layer_health(findings: Sequence[Alarm]) -> dict[str, str]:
    """Worst severity per layer (``"ok"`` is implied for layers not listed)."""
    worst: dict[str, str] = {}
    for alarm in findings:
        if alarm.layer is None:
            continue
        current = worst.get(alarm.layer)
        if current is None or SEVERITY_RANK[alarm.severity] > SEVERITY_RANK[current]:
            worst[alarm.layer] = alarm.severity
    return worst


class HealthTable:
    """Per-layer health of one snapshot, worst first."""

    def __init__(
        self, snapshot: Snapshot, findings: Sequence[Alarm] = (),
        fp16_limit: float = Limits.fp16_limit, title: str | None = None,
        max_rows: int | None = None, sparklines: Mapping[str, Text] | None = None,
    ) -> None:
        self.snapshot = snapshot
        self.findings = findings
        self.fp16_limit = fp16_limit
        self.title = title
        self.max_rows = max_rows
        """At most this many layer rows; the rest (healthiest last) fold into one row."""
        self.sparklines = sparklines
        """Per layer, a trend of max |x| (a column when given)."""

    def rows(self) -> list[tuple[str, LayerStats]]:
        """``(health, stats)`` for the layers seen, worst first, then by max |x|."""
        health = layer_health(self.findings)
        for name, s in self.snapshot.layers.items():
            if s.nonfinite or s.out_nonfinite:
                health[name] = "critical"
        rows = [(health.get(name, "ok"), s) for name, s in self.snapshot.layers.items() if s.seen]
        rows.sort(key=lambda r: (-SEVERITY_RANK.get(r[0], -1), -(r[1].absmax or 0.0)))
        return rows

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        snap = self.snapshot
        span = f"step {snap.step}" if snap.first_step >= snap.step else \
            f"steps {snap.first_step}-{snap.step}"
        title = self.title or f"normwatch · {span}"
        rows = self.rows()
        shown = rows if self.max_rows is None or len(rows) <= self.max_rows else \
            rows[:max(1, self.max_rows - 1)]
        columns = self._columns(shown)
        # fit the width: drop the least telling columns first, then shorten names
        names = [s.name for _, s in shown]
        longest = max((len(n) for n in names), default=10)
        def width(cols: list[tuple[str, list[Any]]], name_width: int) -> int:
            # each column: its widest cell, one space of padding, one border
            return name_width + 2 + sum(2 + max(max(len(p) for p in header(h).split("\n")),
                                                *(len(str(c)) for c in cells))
                                        for h, cells in cols)
        for optional in DROP_ORDER:
            if width(columns, min(longest, NAME_WANTED)) <= options.max_width:
                break
            columns = [c for c in columns if c[0] != optional]
        name_width = max(NAME_MIN, min(longest, options.max_width - width(columns, 0)))
        table = Table(title=title, box=box.ASCII2, title_justify="left", pad_edge=False,
                      caption=LEGEND, caption_justify="left", collapse_padding=True)
        table.add_column("layer", no_wrap=True, min_width=min(longest, name_width))
        for name, _ in columns:
            table.add_column(header(name), no_wrap=True,
                             justify="left" if name in ("health", "dtype", "trend") else "right")
        for i, (health, s) in enumerate(shown):
            label = Text(abbreviate(s.name, name_width), style=STYLES[health]
                         if health != "ok" else "")
            table.add_row(label, *(cells[i] for _, cells in columns))
        folded = rows[len(shown):]
        if folded:  # the healthiest, folded: their count and the worst health among them
            worst = folded[0][0]
            table.add_row(Text(f"+{len(folded)} layers", style="dim"),
                          *([Text(LABELS[worst], style=STYLES[worst])] if columns else []))
        yield table

    def _columns(self, shown: list[tuple[str, LayerStats]]) -> list[tuple[str, list[Any]]]:
        """Every column but the layer name: its statistic and its cells, row by row."""
        grads = any(s.grad_hidden_rms is not None for s in self.snapshot.layers.values())
        cols: dict[str, list[Any]] = {name: [] for name in (
            "health", "absmax", "fp16_headroom", *(["trend"] if self.sparklines is not None
                                                   else []),
            "rms_mean", "rms_max", "eps_dominance", "common_mode_max", "nonfinite",
            *(["grad_hidden_rms"] if grads else []), "dtype")}
        for health, s in shown:
            headroom = self.fp16_limit / s.absmax if s.absmax else None
            cells: dict[str, Any] = {
                "health": Text(LABELS[health], style=STYLES[health]),
                "absmax": _num(s.absmax),
                "fp16_headroom": Text(_num(headroom), style="bold red"
                                      if headroom is not None and headroom < 1 else ""),
                "trend": (self.sparklines or {}).get(s.name, Text("")),
                "rms_mean": _num(s.rms_mean), "rms_max": _num(s.rms_max),
                "eps_dominance": _num(s.eps_dominance),
                "common_mode_max": _num(s.common_mode_max) if s.kind == "rmsnorm" else "-",
                "nonfinite": Text(f"{s.nonfinite}/{s.out_nonfinite}", style="bold red"
                                  if s.nonfinite or s.out_nonfinite else ""),
                "grad_hidden_rms": Text(_num(s.grad_hidden_rms), style="bold red"
                                        if s.grad_hidden_nonfinite else ""),
                "dtype": f"{_short(s.input_dtype)}>{_short(s.weight_dtype)}>"
                         f"{_short(s.output_dtype)}",
            }
            for name, column in cols.items():
                column.append(cells[name])
        return list(cols.items())


NAME_MIN = 16
"""Layer names are shortened (in the middle) to no fewer than this many characters."""
NAME_WANTED = 32
"""Columns are dropped until names get this many characters (or all of theirs)."""
DROP_ORDER = ("rms_max", "common_mode_max", "grad_hidden_rms", "trend", "rms_mean", "dtype")
"""The columns a narrow console drops, first to last."""


def abbreviate(name: str, width: int) -> str:
    """``name`` in at most ``width`` characters, cut in the middle: its first part and as
    much of its end (the layer number and the norm) as fits.

        >>> abbreviate("model.language_model.layers.7.post_attention_layernorm", 32)
        'model…7.post_attention_layernorm'
    """
    if len(name) <= width:
        return name
    head = min(len(name.split(".", 1)[0]) + 1, (width - 1) // 4)
    number = re.search(r"\d+(?!.*\d)", name)  # the last number: which block it is
    if number is not None and len(name) - number.start() < width - 1:
        head = min(head, width - 1 - (len(name) - number.start()))
    return f"{name[:head]}…{name[len(name) - (width - 1 - head):]}"


def alarm_text(alarm: Alarm) -> Text:
    """One alarm as a styled line: ``step 12 WARN fp16_headroom: ...``."""
    label = LABELS[alarm.severity]
    text = Text(f"step {alarm.step} ", style="dim")
    text.append(f"{label} {alarm.kind}", style=STYLES[alarm.severity])
    text.append(f": {alarm.message}")
    return text


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    if abs(value) >= 1e4 or abs(value) < 1e-3:
        return f"{value:.1e}"
    return f"{value:.3g}"


_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64"}


def _short(dtype: str | None) -> str:
    return "-" if dtype is None else _SHORT.get(dtype, dtype)


class ReportSummary:
    """A post-mortem report (the JSON document) for the console: verdict first."""

    def __init__(self, report: dict[str, Any], folder: object | None = None) -> None:
        self.report = report
        self.folder = folder

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        r = self.report
        verdict = r.get("verdict") or {}
        blame = str(verdict.get("blame", "none"))
        style = {"normalization": "bold red", "not_normalization": "bold green",
                 "inconclusive": "bold yellow"}.get(blame, "")
        head = Text(f"normwatch post-mortem · {r.get('trigger')} at step {r.get('step')}",
                    style="bold")
        if r.get("rank") is not None:
            head.append(f" · rank {r['rank']}")
        yield head
        line = Text("blame: ")
        line.append(blame.upper(), style=style)
        if verdict.get("layer"):
            line.append(f" · layer {verdict['layer']}")
        if verdict.get("cause"):
            line.append(f" · cause {verdict['cause']}")
        yield line
        if verdict.get("block"):
            yield Text(f"produced {verdict['block']}")
        for sentence in verdict.get("evidence") or []:
            yield Text(f"  - {sentence}")
        first = r.get("first_nonfinite")
        if first:
            origin = "born in the norm" if first.get("origin") == "norm" else "arrived"
            yield Text(f"first non-finite: step {first.get('step')}, {first.get('layer')} "
                       f"({origin})")
        table = Table(title="last flush per layer (forward order)", box=box.ASCII2,
                      title_justify="left")
        limit = report_limits(r).fp16_limit
        for name in ("layer", "absmax", "fp16_headroom", "rms_mean", "eps_dominance",
                     "nonfinite", "grad_hidden_rms", "dtype"):
            table.add_column(header(name), no_wrap=name != "layer")
        for layer in r.get("layers") or []:
            history = layer.get("history") or []
            if not history:
                continue
            h = history[-1]
            dtypes = layer.get("dtypes") or {}
            absmax = _float(h.get("absmax"))
            table.add_row(str(layer.get("name")), _num(absmax),
                          _num(limit / absmax if absmax else None),
                          _num(_float(h.get("rms_mean"))), _num(_float(h.get("eps_dominance"))),
                          f"{h.get('nonfinite')}/{h.get('out_nonfinite')}",
                          _num(_float(h.get("grad_hidden_rms"))),
                          f"{_short(dtypes.get('input'))}>{_short(dtypes.get('output'))}")
        yield table
        depth = r.get("gradient_depth")
        if depth:
            yield Text(f"gradient depth profile at step {depth.get('step')}: first/last "
                       f"hidden-gradient RMS ratio {_num(_float(depth.get('ratio')))} over "
                       f"{len(depth.get('points') or [])} norms (below 1: decays toward the "
                       "input)")
        updates = r.get("update_history") or []
        if updates:
            last = updates[-1]
            yield Text(f"last optimizer step {last.get('step')}: gradient norm "
                       f"{_num(_float(last.get('grad_norm')))}, update norm "
                       f"{_num(_float(last.get('update_norm')))}, lr "
                       f"{_num(_float(last.get('lr')))}")
        replay = r.get("replay") or {}
        if replay:
            where = ", ".join(f"{k} {v}" for k, v in (replay.get("position") or {}).items())
            yield Text(f"replay step {replay.get('step')}: batch "
                       f"{replay.get('batch_fingerprint') or 'not fingerprinted'}"
                       + (f", {where}" if where else "") + ", RNG states in report.json "
                       f"(torch seed {(replay.get('rng') or {}).get('torch_initial_seed')})")
        guard = r.get("guard") or {}
        if guard.get("skipped_steps"):
            yield Text(f"guard: skipped steps {guard['skipped_steps']}")
        counts: dict[str, int] = {}
        for alarm in r.get("alarms") or []:
            key = f"{alarm.get('severity')} {alarm.get('kind')}"
            counts[key] = counts.get(key, 0) + int(alarm.get("count") or 1)
        if counts:
            yield Text("alarms: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
        if self.folder is not None:
            yield Text(f"report: {self.folder}", style="dim")


def _float(value: Any) -> float | None:
    return number(value)
