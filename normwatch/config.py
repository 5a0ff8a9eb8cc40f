"""Validated, frozen options of a :class:`~normwatch.Watch`.

Every option is checked once, at setup; an error names the option, what was
expected and what was received::

    >>> WatchConfig.from_options(flush_every=0)
    Traceback (most recent call last):
    ...
    normwatch.errors.ConfigError: 'flush_every' must be an int >= 1: got 0
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from normwatch.errors import ConfigError
from normwatch.records import SEVERITIES, Alarm, Limits, Severity


@dataclass(frozen=True)
class WatchConfig:
    """Options of a watch; build with :meth:`from_options` to validate them."""

    flush_every: int = 10
    """Copy statistics to the host every this many optimizer steps."""
    stats_every: int = 4
    """Full statistics every this many steps; the steps between run the cheap sentinel
    (per-token max |x| and non-finite flags of input and output). 1: everything on every
    step."""
    gradients: bool = True
    """Measure the gradients through each norm on full-tier steps (``stats_every``)."""
    gradient_decay_ratio: float = 0.5
    """``gradient_decay`` fires when the hidden state's gradient RMS at the first norm is
    below this fraction of the last norm's, falling with depth."""
    placement: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Where norms sit, by glob pattern of layer names: ``"pre"`` (on a residual branch)
    or ``"post"`` (on the trunk after the add); unlisted norms are inferred."""
    early_warning: bool = True
    """On CUDA: peek at max |x| and non-finite counts every step without stalling (pinned
    memory + events) and flush at once when something is wrong."""
    kernel: Literal["auto", "torch", "triton"] = "auto"
    """Reduction backend: ``auto`` uses the fused Triton kernel for CUDA tensors when
    Triton imports, and on the CPU a small C kernel (compiled at first use, where a C
    compiler is found) for the norm calls (both tiers), the gradients through them, their
    folds and the optimizer's samples; torch's ops otherwise. ``torch``: torch's ops
    everywhere."""
    limits: Limits = dataclasses.field(default_factory=Limits)
    """The thresholds measurements are judged against. As options they are given by name
    (:data:`LIMIT_OPTIONS`: ``fp16_limit``, ``eps_tol``, ``common_mode_tol``,
    ``common_mode_fraction``, ``output_tol``; see :class:`~normwatch.records.Limits`)."""
    output_check_every: int = 10
    """Compare outputs with an fp32 recomputation every this many flushes (0: never)."""
    headroom_ratio: float = 0.25
    """Forecast overflow only once max |x| exceeds this fraction of ``fp16_limit``."""
    headroom_horizon: int = 1000
    """Warn when the forecast says overflow is fewer than this many steps away."""
    include: tuple[str, ...] = ()
    """Glob patterns of layer names to watch (empty: all)."""
    exclude: tuple[str, ...] = ()
    """Glob patterns of layer names to skip."""
    count_eval: bool = False
    """Also measure forwards in eval mode or without grad."""
    log_layers: bool = False
    """Trainer callbacks log every layer's statistics (``normwatch/<layer>/<stat>``), not
    only the worst-layer summaries."""
    raise_on: Severity | None = None
    """Raise :class:`~normwatch.NumericalHealthError` on alarms of this severity or worse."""
    sinks: tuple[Callable[[Alarm], object], ...] = ()
    """Callables that receive every emitted alarm."""
    logger: str = "normwatch"
    """Name of the :mod:`logging` logger alarms go to."""
    spike_window: int = 50
    """Losses in the rolling baseline of the spike detector."""
    spike_warmup: int = 10
    """Finite losses needed before spikes are judged."""
    spike_threshold: float = 6.0
    """A spike exceeds the rolling median by this many robust standard deviations..."""
    spike_min_rel: float = 0.1
    """...and by at least this fraction of the median."""
    report_dir: str | None = "normwatch-reports"
    """Where post-mortem reports go (one folder per incident); ``None``: write none."""
    max_reports: int = 20
    """At most this many report folders per watch."""
    incident_quiet: int = 5
    """An incident stays open (later triggers join it, its verdict stands) until this many
    flushes in a row had no trigger and no critical alarm."""
    report_console: bool = True
    """Print a summary to stderr when a report is written."""
    console: Literal["lines", "live"] | None = None
    """Show the watch on stderr: ``"lines"`` prints the grouped alarm lines and a status
    line per flush (at most every 5 s); ``"live"`` redraws a panel at each flush on a
    terminal (plain lines without one); ``None``: only the ``logging`` records."""
    guard: bool = False
    """Keep a poisoned step from the weights: an optimizer step is not applied when, in
    it, a watched norm's input, output or gradient, or the optimizer's gradients, held
    NaN/inf (parameters and optimizer state stay as if it had not been taken)."""
    guard_max_skips: int = 8
    """After this many skipped steps in a row the guard stops skipping and raises a
    critical alarm (a run that keeps skipping is broken)."""
    history_size: int = 256
    """Flushes kept on the host for blame and reports."""
    blame_lookback: int = 200
    """Steps of history a verdict considers."""
    rank: int | None = None
    """Process rank, for report names and metric labels (set by the integrations)."""
    run_id: str | None = None
    """Identifies the run in metrics and reports (default: generated)."""
    prometheus_port: int | None = None
    """Serve Prometheus metrics on this port (0: any free port; ``None``: no server)."""
    prometheus_addr: str = "127.0.0.1"
    """Address the metrics server binds to (loopback unless you say otherwise)."""
    prometheus_certfile: str | None = None
    """TLS certificate for the metrics server (with ``prometheus_keyfile``)."""
    prometheus_keyfile: str | None = None
    """TLS key for the metrics server."""
    prometheus_aggregate: bool = False
    """Across ranks: export the max/sum over all ranks (one collective per flush)."""

    @classmethod
    def from_options(cls, **options: Any) -> WatchConfig:
        """Validate keyword options into a config (the limits by name, see
        :data:`LIMIT_OPTIONS`); unknown names are errors."""
        names = list(option_defaults())
        for key in options:
            if key not in names:
                near = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise ConfigError(f"unknown option {key!r}{hint} (valid: {', '.join(names)})")
        for key in ("include", "exclude", "sinks"):
            if key in options:
                options[key] = _as_tuple(key, options[key])
        limits = {k: options.pop(k) for k in LIMIT_OPTIONS if k in options}
        config = cls(**options, limits=Limits(**limits))
        config.validate()
        return config

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad option."""
        _int(self.flush_every, "flush_every", minimum=1)
        _int(self.output_check_every, "output_check_every", minimum=0)
        _int(self.stats_every, "stats_every", minimum=1)
        if self.kernel not in ("auto", "torch", "triton"):
            raise ConfigError(f"'kernel' must be one of 'auto', 'torch', 'triton': got "
                              f"{self.kernel!r}")
        _int(self.headroom_horizon, "headroom_horizon", minimum=1)
        _int(self.spike_window, "spike_window", minimum=3)
        _int(self.spike_warmup, "spike_warmup", minimum=1)
        _int(self.max_reports, "max_reports", minimum=0)
        _int(self.incident_quiet, "incident_quiet", minimum=1)
        _int(self.history_size, "history_size", minimum=1)
        _int(self.guard_max_skips, "guard_max_skips", minimum=1)
        _int(self.blame_lookback, "blame_lookback", minimum=1)
        _number(self.spike_threshold, "spike_threshold", low=0.0, low_open=True)
        _number(self.spike_min_rel, "spike_min_rel", low=0.0)
        if self.rank is not None:
            _int(self.rank, "rank", minimum=0)
        if self.report_dir is not None and (not isinstance(self.report_dir, str | os.PathLike)
                                            or str(self.report_dir) == ""):
            raise ConfigError(f"'report_dir' must be a folder path or None: got "
                              f"{self.report_dir!r}")
        if self.prometheus_port is not None:
            _int(self.prometheus_port, "prometheus_port", minimum=0)
            if self.prometheus_port > 65535:
                raise ConfigError(f"'prometheus_port' must be <= 65535: got "
                                  f"{self.prometheus_port}")
        for key in ("prometheus_addr", "run_id", "prometheus_certfile", "prometheus_keyfile"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{key!r} must be a non-empty str: got {value!r}")
        if (self.prometheus_certfile is None) != (self.prometheus_keyfile is None):
            raise ConfigError("'prometheus_certfile' and 'prometheus_keyfile' go together: got "
                              f"{self.prometheus_certfile!r} and {self.prometheus_keyfile!r}")
        if not isinstance(self.prometheus_aggregate, bool):
            raise ConfigError(f"'prometheus_aggregate' must be a bool: got "
                              f"{self.prometheus_aggregate!r}")
        if self.console not in (None, "lines", "live"):
            raise ConfigError(f"'console' must be None, 'lines' or 'live': got {self.console!r}")
        if not isinstance(self.report_console, bool):
            raise ConfigError(f"'report_console' must be a bool: got {self.report_console!r}")
        limits = self.limits
        if not isinstance(limits, Limits):
            raise ConfigError(f"'limits' must be a normwatch Limits: got {limits!r}")
        _number(limits.fp16_limit, "fp16_limit", low=0.0, low_open=True)
        _number(limits.eps_tol, "eps_tol", low=0.0, high=1.0, low_open=True, high_open=True)
        _number(limits.common_mode_tol, "common_mode_tol", low=0.0, high=1.0, low_open=True)
        _number(limits.common_mode_fraction, "common_mode_fraction", low=0.0, high=1.0)
        _number(self.headroom_ratio, "headroom_ratio", low=0.0, high=1.0, low_open=True,
                high_open=True)
        if limits.output_tol is not None:
            _number(limits.output_tol, "output_tol", low=0.0, low_open=True)
        for key in ("include", "exclude"):
            for pattern in getattr(self, key):
                if not isinstance(pattern, str):
                    raise ConfigError(
                        f"{key!r} must be a sequence of str patterns: got "
                        f"{type(pattern).__name__} {pattern!r}"
                    )
        _number(self.gradient_decay_ratio, "gradient_decay_ratio", low=0.0, low_open=True)
        if not isinstance(self.placement, Mapping) or any(
                not isinstance(k, str) or v not in ("pre", "post")
                for k, v in self.placement.items()):
            raise ConfigError(f"'placement' must map layer-name patterns to 'pre' or 'post': "
                              f"got {self.placement!r}")
        if not isinstance(self.early_warning, bool):
            raise ConfigError(f"'early_warning' must be a bool: got {self.early_warning!r}")
        for flag in ("count_eval", "log_layers", "gradients", "guard"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"'{flag}' must be a bool: got {getattr(self, flag)!r}")
        if self.raise_on is not None and self.raise_on not in SEVERITIES:
            raise ConfigError(
                f"'raise_on' must be one of None, 'info', 'warning', 'critical': "
                f"got {self.raise_on!r}"
            )
        for sink in self.sinks:
            if not callable(sink):
                raise ConfigError(f"'sinks' must hold callables: got {type(sink).__name__}")
        if not isinstance(self.logger, str) or not self.logger:
            raise ConfigError(f"'logger' must be a non-empty str: got {self.logger!r}")


LIMIT_OPTIONS = tuple(f.name for f in dataclasses.fields(Limits))
"""The options that make up :attr:`WatchConfig.limits`."""


def option_defaults() -> dict[str, Any]:
    """Every option name and its default, the limits' by name."""
    limits = Limits()
    out: dict[str, Any] = {}
    for f in dataclasses.fields(WatchConfig):
        if f.name == "limits":
            out.update({name: getattr(limits, name) for name in LIMIT_OPTIONS})
        else:
            out[f.name] = getattr(WatchConfig(), f.name)
    return out


def _as_tuple(key: str, value: Any) -> tuple[Any, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or callable(value):
        return (value,)
    if isinstance(value, Sequence | set | frozenset):
        return tuple(value)
    raise ConfigError(f"{key!r} must be a sequence: got {type(value).__name__} {value!r}")


def _int(value: Any, key: str, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key!r} must be an int >= {minimum}: got {value!r}")


def _number(
    value: Any,
    key: str,
    *,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (
            value < high if high_open else value <= high
        )
    if not ok:
        lo = f"{'(' if low_open else '['}{low:g}"
        hi = f"{high:g}{')' if high_open else ']'}"
        raise ConfigError(f"{key!r} must be a finite number in {lo}, {hi}: got {value!r}")


ENV_PREFIX = "NORMWATCH_"
SETTINGS = ("RUN", "CACHE", "NATIVE", "LANE")
"""``NORMWATCH_<NAME>`` variables that set the process up, not options: the mark of
``normwatch run``'s children, the native build's cache and its two switches."""


def options_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """:class:`WatchConfig` options from ``NORMWATCH_<OPTION>`` variables, parsed by the
    option's type (``NORMWATCH_FLUSH_EVERY=5``, ``NORMWATCH_REPORT_DIR=none``,
    ``NORMWATCH_INCLUDE=a.*,b.*``); unknown names are refused with the known ones."""
    environ = os.environ if environ is None else environ
    defaults = option_defaults()
    options: dict[str, Any] = {}
    for key, text in environ.items():
        suffix = key[len(ENV_PREFIX):]
        if not key.startswith(ENV_PREFIX) or suffix in SETTINGS:
            continue
        name = suffix.lower()
        if name not in defaults:
            raise ConfigError(f"environment variable {key!r} names no option; known: "
                              + ", ".join(f"{ENV_PREFIX}{n.upper()}" for n in defaults))
        options[name] = _parse(name, text, defaults[name])
    return options


def _parse(name: str, text: str, default: Any) -> Any:
    if text.lower() in ("none", "null", ""):
        return None
    if isinstance(default, bool):
        if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise ConfigError(f"'{name}' must be a bool (1/0/true/false): got {text!r}")
        return text.lower() in ("1", "true", "yes")
    if isinstance(default, tuple):
        return tuple(p for p in text.split(",") if p)
    if isinstance(default, Mapping):  # NORMWATCH_PLACEMENT=blocks.*.norm=post,final=pre
        return dict(p.split("=", 1) for p in text.split(",") if "=" in p)
    numeric = default is None or isinstance(default, int | float)  # bools returned above
    for kind in (int, float) if numeric else ():
        try:
            return kind(text)
        except ValueError:
            continue
    return text
