"""Post-mortem reports: a versioned JSON document, written and read back as JSON only.

    >>> folder = write_report(build_report(...), "normwatch-reports")
    >>> report = load_report(folder)          # ReportError with a clear message if bad

Schema (``docs/reference/report-schema.md``): ``schema``, ``version``, ``created``, ``trigger``,
``step``, ``rank``, ``limits``, ``verdict``, ``first_nonfinite``, ``layers`` (with each
layer's recent ``history``), ``alarms``, ``loss_history``, ``spikes``, ``update_history``,
``gradient_depth``, ``environment``, ``exception``.
Non-finite numbers are stored as the strings ``"nan"``, ``"inf"``, ``"-inf"`` (strict JSON).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import os
import platform
import re
import tempfile
import traceback
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from normwatch._version import __version__
from normwatch.catalog import TABLE
from normwatch.errors import ConfigError
from normwatch.judge.history import Record, first_nonfinite
from normwatch.judge.incidents import Incident
from normwatch.judge.spikes import Spike
from normwatch.records import (
    Alarm,
    GuardEvent,
    Limits,
    NormLayer,
    ReplayPoint,
    UpdateStats,
    Verdict,
)

if TYPE_CHECKING:
    import torch

SCHEMA = "normwatch.report"
VERSION = 1
HISTORY_FIELDS = tuple(s.name for s in TABLE if s.history)
"""Per-flush statistics kept in each layer's ``history`` (declared in the catalog)."""


class ReportError(ValueError):
    """A report path is missing, unreadable, not JSON, or not a normwatch report."""


def build_report(
    *,
    trigger: str,
    step: int,
    verdict: Verdict | None,
    layers: Sequence[NormLayer],
    order: Sequence[str],
    records: Sequence[Record],
    alarms: Sequence[Alarm],
    losses: Sequence[tuple[int, float]],
    spikes: Sequence[Spike],
    rank: int | None = None,
    exception: BaseException | None = None,
    limits: Limits | None = None,
    updates: Sequence[UpdateStats] = (),
    incident: Incident | None = None,
    guard: Sequence[GuardEvent] | None = None,
    replay: ReplayPoint | None = None,
    devices: Sequence[str] = (),
) -> dict[str, Any]:
    """The report document as plain JSON-able data (pure: no I/O). ``incident``: the
    incident reported (its timeline); ``guard``: the guard's poisoned steps (``None``: no
    guard); ``replay``: what re-runs the incident's first step; ``devices``: where the
    watched model ran; the gradient depth profile is the records'."""
    first = first_nonfinite(records)
    position = {name: i for i, name in enumerate(order)}
    ordered = sorted(layers, key=lambda x: position.get(x.name, len(order) + layers.index(x)))
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "trigger": trigger,
        "step": step,
        "rank": rank,
        "limits": dataclasses.asdict(limits or Limits()),
        "verdict": None if verdict is None else _clean(dataclasses.asdict(verdict)),
        "incident": None if incident is None else {
            "number": incident.number, "first_step": incident.first_step,
            "last_step": incident.events[-1].step, "closed": incident.closed,
            "timeline": [{"trigger": e.trigger, "step": e.step, "note": e.note,
                          "what": e.what} for e in incident.events]},
        "first_nonfinite": None if first is None else dataclasses.asdict(first),
        "layers": [_layer(layer, position.get(layer.name), records) for layer in ordered],
        "alarms": [_clean({k: v for k, v in dataclasses.asdict(a).items() if k != "tag"})
                   for a in alarms],
        "loss_history": [[s, _num(v)] for s, v in losses],
        "spikes": [{"step": s.step, "loss": _num(s.loss), "baseline": _num(s.baseline),
                    "margin": _num(s.margin)} for s in spikes],
        "update_history": [{"step": u.step, "grad_norm": _num(u.grad_norm),
                            "update_norm": _num(u.update_norm), "param_norm": _num(u.param_norm),
                            "lr": _num(u.lr)} for u in updates],
        "guard": None if guard is None else {
            "skipped_steps": [e.step for e in guard if e.skipped],
            "events": [{"step": e.step, "reasons": list(e.reasons), "skipped": e.skipped}
                       for e in guard]},
        "replay": None if replay is None else {
            "step": replay.step, "batch_fingerprint": replay.fingerprint,
            "position": dict(replay.position), "rng": dict(replay.rng)},
        "gradient_depth": gradient_depth(records),
        "environment": environment(records, devices),
        "exception": None if exception is None else {
            "type": type(exception).__name__,
            "message": str(exception),
            "traceback": "".join(traceback.format_exception(exception)),
        },
    }


def gradient_depth(records: Sequence[Record]) -> dict[str, Any] | None:
    """The hidden-state gradient by depth at the last flush that measured one."""
    for record in reversed(records):
        profile = record.profile
        if profile is not None:
            return {"step": record.snapshot.step, "ratio": _num(profile.ratio),
                    "points": [{"layer": p.layer, "rms": _num(p.hidden_rms),
                                "placement": p.placement} for p in profile.points]}
    return None


def device_name(device: torch.device) -> str:
    """``cpu``, or ``cuda:0 (NVIDIA H200)``: a GPU with its name."""
    import torch

    if device.type != "cuda":
        return str(device)
    return f"{device} ({torch.cuda.get_device_name(device)})"


def environment(records: Sequence[Record] = (), devices: Sequence[str] = ()
                ) -> dict[str, Any]:
    """Versions, devices (``ran_on``: the watched model's, e.g. ``cuda:0 (NVIDIA H200)``;
    ``devices``: the machine's) and the dtypes the norms saw."""
    dtypes: dict[str, set[str]] = {"input": set(), "weight": set(), "output": set()}
    autocast: set[str] = set()
    for record in records:
        for s in record.snapshot.layers.values():
            for key, value in (("input", s.input_dtype), ("weight", s.weight_dtype),
                               ("output", s.output_dtype)):
                if value:
                    dtypes[key].add(value)
            if s.autocast:
                autocast.add(s.autocast)
    import torch  # here: loading a report (and normwatch run's launcher) needs no torch

    return {
        "normwatch": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.version.cuda,
        "ran_on": list(devices),
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        or ["cpu"],
        "dtypes": {k: sorted(v) for k, v in dtypes.items()},
        "autocast": sorted(autocast),
    }


def write_report(report: Mapping[str, Any], report_dir: str | Path,
                 html: str | None = None, folder: Path | None = None) -> Path:
    """Write ``report.json`` (and ``report.html`` if given) into a new folder under
    ``report_dir``, or over the files of ``folder`` (an incident's report rewritten: each
    file replaced whole, never left half-written); returns the folder."""
    if folder is None:
        folder = _new_folder(report, report_dir)
    _replace(folder / "report.json", json.dumps(report, indent=1, allow_nan=False) + "\n")
    if html is not None:
        _replace(folder / "report.html", html)
    return folder


def _new_folder(report: Mapping[str, Any], report_dir: str | Path) -> Path:
    """A new folder under ``report_dir`` named after the report's time, step and trigger."""
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    rank = f"-rank{report['rank']}" if report.get("rank") is not None else ""
    base = f"{stamp}-step{report['step']}-{_slug(str(report['trigger']))}{rank}"
    root = Path(report_dir)
    root.mkdir(parents=True, exist_ok=True)
    folder = root / base
    n = 1
    while folder.exists():
        n += 1
        folder = root / f"{base}-{n}"
    folder.mkdir()
    return folder


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def prepare_report_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` (with parents) and check it is a writable folder, when the watch
    starts rather than when a report would be lost; :class:`ConfigError` otherwise."""
    folder = Path(path)
    if str(path) == "":
        raise ConfigError("'report_dir' must be a folder path or None: got ''")
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"'report_dir' must be a folder: got {str(path)!r}, which is a file")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"'report_dir' must be a folder normwatch can create: got "
                          f"{str(path)!r} ({exc.strerror or exc})") from None
    try:  # a real write: permissions alone do not tell a read-only mount
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ConfigError(f"'report_dir' must be writable: got {str(path)!r} "
                          f"({exc.strerror or exc})") from None
    return folder


def load_report(path: str | Path) -> dict[str, Any]:
    """Read a report folder (or its ``report.json``); JSON only, validated."""
    p = Path(path)
    file = p / "report.json" if p.is_dir() else p
    if not file.exists():
        raise ReportError(f"no normwatch report at {str(path)!r}: expected a report folder "
                          "or its report.json")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ReportError(f"{file} is not valid JSON: {exc.msg} at line {exc.lineno}, "
                          f"column {exc.colno}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"cannot read {file}: {exc}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ReportError(f"{file} is not a normwatch report: 'schema' must be {SCHEMA!r}: "
                          f"got {data.get('schema') if isinstance(data, dict) else type(data)!r}")
    if data.get("version") != VERSION:
        raise ReportError(f"{file}: unsupported report version {data.get('version')!r} "
                          f"(this normwatch reads version {VERSION})")
    missing = [k for k in ("verdict", "layers", "alarms", "loss_history", "environment")
               if k not in data]
    if missing:
        raise ReportError(f"{file}: missing fields {', '.join(missing)}")
    return data


def report_limits(report: Mapping[str, Any]) -> Limits:
    """The limits a report was judged with (the defaults for reports that predate them)."""
    stored = report.get("limits")
    if not isinstance(stored, Mapping):
        return Limits()
    known = {f.name for f in dataclasses.fields(Limits)}
    kept: dict[str, Any] = {k: v for k, v in stored.items() if k in known and (
        v is None or (isinstance(v, int | float) and not isinstance(v, bool)))}
    return Limits(**kept)


def number(value: Any) -> float | None:
    """A stored number back as float (``"nan"``/``"inf"`` strings included)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if value in ("nan", "inf", "-inf"):
        return float(value)
    return None


def _layer(layer: NormLayer, position: int | None, records: Iterable[Record]) -> dict[str, Any]:
    history = []
    for record in records:
        s = record.snapshot.layers.get(layer.name)
        if s is None or not s.seen:
            continue
        row: dict[str, Any] = {"step": record.snapshot.step}
        row.update({f: _num(getattr(s, f)) for f in HISTORY_FIELDS})
        history.append(row)
    last = next((r.snapshot.layers[layer.name] for r in reversed(list(records))
                 if layer.name in r.snapshot.layers and r.snapshot.layers[layer.name].seen), None)
    return {
        "name": layer.name, "kind": layer.kind, "eps": _num(layer.eps_written),
        "eps_measured": layer.eps_measured,
        "eps_as_measured": _num(layer.eps) if layer.eps_measured else None,
        "normalized_shape": list(layer.normalized_shape or ()), "weight_form": layer.weight_form,
        "class_name": layer.class_name, "position": position,
        "dtypes": None if last is None else {"input": last.input_dtype,
                                             "weight": last.weight_dtype,
                                             "output": last.output_dtype,
                                             "autocast": last.autocast},
        "history": history,
    }


def _num(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _clean(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _clean(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [_clean(v) for v in data]
    return _num(data)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text)[:40] or "event"
