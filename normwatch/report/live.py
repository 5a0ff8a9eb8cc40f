"""A console people keep open: a live panel redrawn at each flush, or plain lines.

    >>> view = ConsoleView(console, live=True)      # watch(console="live") makes one
    >>> view.update(LiveState(...))                 # at each flush
    >>> view.close()

:class:`LivePanel` renders one :class:`LiveState` (pure: tested on a recording console):
step, tokens/s and the time since the last flush; the health table, worst layers first,
capped to the terminal's height with the healthy layers folded into one row, each layer
with a sparkline of its max |x| against the fp16 limit; the latest grouped alarm lines.
:class:`ConsoleView` owns the side effects: a ``rich.live.Live`` on a terminal, plain
lines (one per grouped warning or critical alarm — info alarms are shown in the panel,
logged and counted in the watch's exit line, so a healthy run prints none — and one
status line per flush at most every few seconds) without one — CI logs stay readable.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.live import Live
from rich.text import Text

from normwatch.pipeline import BUILD_LOG, Flush
from normwatch.records import SEVERITY_RANK, Alarm, Snapshot
from normwatch.report.console import HealthTable, alarm_text, stderr_console
from normwatch.report.lines import verdict_line

BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], limit: float) -> Text:
    """``values`` (max |x| over flushes) as bars on a log scale from limit/1000 to the
    limit; past the limit a red ``!``."""
    out = Text()
    for v in values:
        if not math.isfinite(v) or v > limit:
            out.append("!", style="bold red")
            continue
        level = (math.log10(max(v / limit, 1e-3)) + 3) / 3  # 0 .. 1
        out.append(BARS[min(len(BARS) - 1, int(level * len(BARS)))],
                   style="yellow" if v > limit / 4 else "green")
    return out


@dataclass
class LiveState:
    """What the panel shows after one flush."""

    snapshot: Snapshot
    findings: Sequence[Alarm]
    fp16_limit: float
    history: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """Per layer, max |x| at the last flushes (oldest first)."""
    lines: Sequence[Alarm] = ()
    """The latest grouped alarm lines, oldest first."""
    tokens_per_s: float | None = None
    flushed_at: float | None = None
    """``time.monotonic()`` of the flush (the panel says how long ago, as it redraws)."""


class LivePanel:
    """The renderable of one :class:`LiveState`; ``height``: the most lines it may use."""

    def __init__(self, state: LiveState, height: int | None = None, alarms: int = 5,
                 now: float | None = None) -> None:
        self.state = state
        self.height = height
        self.alarms = alarms
        self.now = now

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        s = self.state
        head = Text(f"normwatch · step {s.snapshot.step}", style="bold")
        if s.tokens_per_s is not None:
            head.append(f" · {s.tokens_per_s:,.0f} tokens/s")
        if s.flushed_at is not None:
            since = (time.monotonic() if self.now is None else self.now) - s.flushed_at
            head.append(f" · last flush {since:.0f} s ago", style="dim")
        lines = list(s.lines)[-self.alarms:]
        height = self.height or options.height or options.max_height
        # head, alarms, table chrome (title, borders, header, legend) take the rest
        rows = max(1, height - 1 - len(lines) - 10)
        table = HealthTable(s.snapshot, s.findings, s.fp16_limit, max_rows=rows,
                            sparklines={k: sparkline(v, s.fp16_limit)
                                        for k, v in s.history.items()})
        yield Group(head, table, *(alarm_text(a) for a in lines))


class ConsoleView:
    """Where a watch's console output goes; see the module docstring."""

    def __init__(self, console: Console | None = None, live: bool | None = None,
                 status_every_s: float = 5.0) -> None:
        self.console = console or stderr_console()
        self.live = self.console.is_terminal if live is None else live
        self.status_every_s = status_every_s
        self._live: Live | None = None
        self._lines: list[Alarm] = []
        self._last = time.monotonic()
        self._last_status = -math.inf
        self._builds = _BuildNotes(self)
        """Says when normwatch's native parts are being built (a first run waits for it)."""
        build_log = logging.getLogger(BUILD_LOG)
        if build_log.level == logging.NOTSET:
            build_log.setLevel(logging.INFO)
        build_log.addHandler(self._builds)

    def on_flush(self, flush: Flush) -> None:
        """The watch's sink: the flush's alarm lines, the panel or status line, its
        verdict."""
        for alarm in flush.lines:
            self.alarm(alarm)
        self.update(flush.snapshot, flush.health, flush.limits.fp16_limit, dict(flush.trends))
        self._verdicts(flush)

    def on_exception(self, flush: Flush, exc: BaseException) -> None:
        """The verdict on the run's end: the incident's (new, or the one that stands)."""
        incident = None if flush.ruling is None else flush.ruling.incident
        if incident is not None:
            self.note(verdict_line(incident.verdict), style="bold red")

    def _verdicts(self, flush: Flush) -> None:
        for verdict in flush.new_verdicts:
            self.note(verdict_line(verdict), style="bold red")

    def note(self, text: str, style: str = "") -> None:
        """A line of its own (attach, verdict, end of the watch), never wrapped."""
        self.console.print(Text(text, style=style), soft_wrap=True)

    def alarm(self, alarm: Alarm) -> None:
        """A grouped alarm line (a watch sink): printed now, or shown in the panel."""
        self._lines = [*self._lines, alarm][-20:]
        if self._live is None and SEVERITY_RANK[alarm.severity] >= SEVERITY_RANK["warning"]:
            self.console.print(alarm_text(alarm))

    def update(self, snapshot: Snapshot, findings: Sequence[Alarm], fp16_limit: float,
               history: dict[str, tuple[float, ...]]) -> None:
        """After a flush: redraw the panel, or print a status line (at most every
        ``status_every_s`` seconds)."""
        now = time.monotonic()
        elapsed, self._last = now - self._last, now
        tokens = max((s.tokens for s in snapshot.layers.values()), default=0)
        state = LiveState(snapshot, findings, fp16_limit, history, list(self._lines),
                          tokens / elapsed if elapsed > 0 else None, now)
        if self.live:
            if self._live is None:
                self._live = Live(console=self.console, refresh_per_second=4,
                                  transient=False)
                self._live.start()
            self._live.update(LivePanel(state, self.console.height), refresh=True)
            return
        if now - self._last_status >= self.status_every_s:
            self._last_status = now
            self.console.print(Text(status_line(state), style="dim"))

    def close(self) -> None:
        """Stop the live display (the last panel stays on screen)."""
        logging.getLogger(BUILD_LOG).removeHandler(self._builds)
        if self._live is not None:
            self._live.stop()
            self._live = None


class _BuildNotes(logging.Handler):
    """A view's handler on the build logger: each build's start as a dim note."""

    def __init__(self, view: ConsoleView) -> None:
        super().__init__(logging.INFO)
        self.view = view

    def emit(self, record: logging.LogRecord) -> None:
        self.view.note(record.getMessage(), style="dim")


def status_line(state: LiveState) -> str:
    """The plain one-line status: step, the largest max |x| and where, tokens/s."""
    line = f"normwatch · step {state.snapshot.step}"
    seen = [s for s in state.snapshot.layers.values() if s.absmax is not None]
    if seen:
        worst = max(seen, key=lambda s: s.absmax or 0.0)
        absmax = worst.absmax or 0.0
        line += (f" · max |x| {absmax:.4g} in {worst.name} "
                 f"({absmax / state.fp16_limit:.2f} of the fp16 limit)")
    if state.tokens_per_s is not None:
        line += f" · {state.tokens_per_s:,.0f} tokens/s"
    return line
