"""``normwatch demo``: train a tiny pre-norm transformer into a chosen fault, live.

    >>> result = run_demo("fp16-overflow", steps=150)
    >>> result.first_warning_step < result.nan_step

Everything runs in well under a minute, on the CPU or a GPU (``device``). The faults
are real failure mechanisms; only their trigger is scripted (a drifting residual scale, a padding
batch, a flag inside an MLP) so that each one shows up within a few dozen steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console, Group
from rich.markup import escape

from normwatch.demos.faults import DEFAULT_FAULT, FAULTS, Fault
from normwatch.demos.toymodel import TinyLM, lm_loss, synthetic_batch
from normwatch.errors import ConfigError
from normwatch.judge.incidents import lead_warning
from normwatch.pipeline import Sink
from normwatch.records import SEVERITY_RANK, Alarm, NormLayer, Verdict
from normwatch.report.console import HealthTable
from normwatch.report.document import device_name
from normwatch.report.live import ConsoleView
from normwatch.watching import Watch, watch


@dataclass
class DemoResult:
    """What a demo run observed."""

    fault: str
    steps_run: int
    alarms: list[Alarm]
    device: str = "cpu"
    """Where the drill ran, with the GPU's name (``cuda:0 (NVIDIA H200)``)."""
    layers: tuple[NormLayer, ...] = ()
    """The norm layers the watch found."""
    nan_step: int | None = None
    losses: list[float] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    reports: list[Path] = field(default_factory=list)

    def first_step(self, min_severity: str = "warning") -> int | None:
        """First step with an alarm of at least ``min_severity``."""
        rank = SEVERITY_RANK[min_severity]
        steps = [a.step for a in self.alarms if SEVERITY_RANK[a.severity] >= rank]
        return min(steps) if steps else None


DEVICES = ("auto", "cpu", "cuda")


def pick_device(device: str) -> torch.device:
    """``auto``: the GPU where one is up, else the CPU; ``cuda`` without one is an error
    (:class:`~normwatch.errors.ConfigError`) that says so."""
    if device not in DEVICES:
        raise ConfigError(f"'device' must be one of {', '.join(DEVICES)}: got {device!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        why = "this torch is a CPU build" if torch.version.cuda is None else \
            "torch finds no CUDA device (driver, CUDA_VISIBLE_DEVICES)"
        raise ConfigError(f"'device' is 'cuda' but {why}: use --device cpu or auto")
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" \
        else torch.device("cpu")


def build(fault: Fault, seed: int, device: torch.device | str = "cpu"
          ) -> tuple[TinyLM, torch.optim.Optimizer]:
    """The model and optimizer of a drill (deterministic for a seed)."""
    torch.manual_seed(seed)
    model = TinyLM(norm=fault.norm, eps=fault.eps, padding_idx=0 if fault.padding else None)
    model.to(device=device, dtype=getattr(torch, fault.dtype))
    fault.prepare(model)
    return model, torch.optim.SGD(model.parameters(), lr=fault.lr, momentum=0.9)


def run_demo(
    fault_name: str = DEFAULT_FAULT,
    steps: int = 200,
    seed: int = 0,
    console: Console | None = None,
    live: bool | None = None,
    flush_every: int = 1,
    report_dir: str | None = "normwatch-reports",
    device: str = "cpu",
    sinks: Sequence[Sink] = (),
) -> DemoResult:
    """Train until ``steps`` or a non-finite loss; print alarms and the table. ``device``:
    ``cpu``, ``cuda`` or ``auto`` (the GPU where one is up); the batches are drawn on the
    CPU, so a seed's drill is the same data on either. ``sinks``: added to the watch (each
    gets every flush, as the console does)."""
    fault = FAULTS[fault_name]
    where = pick_device(device)
    console = console or Console(width=None if _tty() else 120)
    live = console.is_terminal if live is None else live
    model, optimizer = build(fault, seed, where)
    gen = torch.Generator().manual_seed(seed)
    result = DemoResult(fault.name, 0, [], device=device_name(where))
    console.print(f"[bold]normwatch demo[/] · fault [bold]{fault.name}[/]: {fault.summary} "
                  f"· on {escape(result.device)}")
    view = ConsoleView(console, live=live)  # from here: a first run says what it builds
    # A small model: full statistics on every step make the live table richest.
    with watch(model, optimizer, flush_every=flush_every, report_dir=report_dir,
               report_console=False, stats_every=1) as w:
        w.view = view
        result.layers = w.layers
        for sink in sinks:
            w.add_sink(sink)
        for step in range(1, steps + 1):
            fault.before_step(model, step)
            tokens = fault.batch(synthetic_batch(gen), step).to(where)
            if fault.padding:
                tokens[:, -8:] = 0
            loss = lm_loss(model(tokens), tokens)
            loss.backward()  # type: ignore[no-untyped-call]
            for group in optimizer.param_groups:
                group["lr"] = fault.lr * fault.lr_factor(step)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            w.step(loss)
            value = float(loss.detach())
            result.losses.append(value)
            result.steps_run = step
            if not math.isfinite(value):
                result.nan_step = step
                break
        view.close()
        result.alarms = list(w.alarms)
        result.verdicts = list(w.verdicts)
        result.reports = list(w.reports)
        if w.last_snapshot is not None and not live:  # the live panel stays on screen
            console.print(_table(w, result.steps_run))
    console.print(summary(result))
    return result


def _table(w: Watch, step: int) -> Group | HealthTable | str:
    if w.last_snapshot is None:
        return f"step {step}: waiting for the first flush"
    return HealthTable(w.last_snapshot, w.health_findings, w.config.limits.fp16_limit)


def summary(result: DemoResult) -> str:
    """A few closing lines: what fired, when, and how early."""
    lines = [f"[bold]summary[/] · {result.fault}: {result.steps_run} steps on "
             f"{escape(result.device)}"]
    kinds: dict[str, Alarm] = {}
    for alarm in result.alarms:
        kinds.setdefault(f"{alarm.severity} {alarm.kind}", alarm)
    for key, alarm in kinds.items():
        lines.append(f"  first {key} at step {alarm.step} ({alarm.layer or '-'})")
    if not kinds:
        lines.append("  no alarms: every norm layer stayed healthy")
    lead = lead_warning(result.alarms, result.verdicts[0]) if result.verdicts else None
    if result.nan_step is not None:
        lines.append(f"  loss became non-finite at step {result.nan_step}")
        if lead is not None and lead.step < result.nan_step:
            lines.append(f"  normwatch warned {result.nan_step - lead.step} steps before the "
                         f"NaN loss ({lead.kind} at step {lead.step})")
    for verdict in result.verdicts[:1]:
        where = f" ({verdict.layer})" if verdict.layer else ""
        cause = f", cause {verdict.cause}" if verdict.cause else ""
        lines.append(f"  verdict on {verdict.trigger} at step {verdict.step}: "
                     f"[bold]{verdict.blame}[/]{where}{cause}")
        if verdict.evidence:
            lines.append(f"    {escape(verdict.evidence[0])}")
    for i, report in enumerate(result.reports):
        head = "post-mortems:" if i == 0 else "             "
        if len(result.reports) == 1:
            head = "post-mortem:"
        lines.append(f"  {head} {report}")
    if result.reports:
        lines.append("  (normwatch report PATH re-reads one)")
    return "\n".join(lines)


def _tty() -> bool:
    import sys

    return sys.stdout.isatty()
