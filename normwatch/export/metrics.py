"""A snapshot as flat ``{name: number}`` metrics for experiment loggers.

    >>> flat_metrics(snapshot, watch.alarms, len(watch.verdicts), limits=watch.config.limits)
    {'normwatch/absmax_max': 3.2, 'normwatch/absmax_max_layer': 4.0, ...,
     'normwatch/alarms/critical': 0.0}
    >>> watch.add_sink(LoggerMetrics(logger.log_metrics))   # at every flush

:func:`flat_metrics` is pure; :class:`LoggerMetrics` is the thin sink the trainer
callbacks add.

By default a handful of worst-layer summaries (:data:`SUMMARY`): a 60-layer model logs
as many keys as a 2-layer one; with an optimizer watched, its last step's ``grad_norm``,
``update_norm`` and ``update_ratio`` (update over parameter norm). With ``per_layer``
every layer's statistics that :data:`normwatch.catalog.TABLE` marks ``logged`` as
``normwatch/<layer>/<stat>`` too.
Only finite numbers are returned, so loggers never receive NaN; layers not called in the
interval are left out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from normwatch.catalog import TABLE, layer_values
from normwatch.pipeline import Flush
from normwatch.records import SEVERITIES, Alarm, Limits, Snapshot

if TYPE_CHECKING:
    from normwatch.export.crossrank import VerdictExchange

LOGGED = tuple(s.name for s in TABLE if s.logged)
SUMMARY = ("absmax_max", "absmax_max_layer", "fp16_headroom_min", "eps_dominance_max",
           "nonfinite_tokens")
"""The default metrics besides alarm and verdict counts: the largest max |x| over the
layers and that layer's position in ``order`` (forward order, 0-based), the smallest
fp16 headroom, the largest eps dominance, and the non-finite tokens (inputs and outputs)
of every layer."""


def flat_metrics(snapshot: Snapshot, alarms: Sequence[Alarm] = (), verdicts: int = 0,
                 prefix: str = "normwatch/", limits: Limits | None = None,
                 per_layer: bool = False, order: Sequence[str] = ()) -> dict[str, float]:
    """Worst-layer summaries (:data:`SUMMARY`; fp16 headroom against ``limits``),
    ``per_layer`` statistics on request, cumulative alarm counts by severity, and the
    number of verdicts."""
    limits = limits or Limits()
    out: dict[str, float] = {}
    measured = {name: layer_values(stats, limits) for name, stats in snapshot.layers.items()
                if stats.seen}
    out.update(_summary(measured, order, prefix))
    if snapshot.updates:  # the interval's last optimizer step
        last = snapshot.updates[-1]
        for name, value in (("grad_norm", last.grad_norm), ("update_norm", last.update_norm),
                            ("update_ratio", last.update_ratio)):
            if value is not None and math.isfinite(value):
                out[f"{prefix}{name}"] = float(value)
    for name, values in measured.items() if per_layer else ():
        for field in LOGGED:
            value = values[field]
            if value is not None and math.isfinite(value):
                out[f"{prefix}{name}/{field}"] = float(value)
    for severity in SEVERITIES:
        out[f"{prefix}alarms/{severity}"] = float(
            sum(a.count for a in alarms if a.severity == severity))
    out[f"{prefix}verdicts"] = float(verdicts)
    return out


class LoggerMetrics:
    """A sink of the watch: each flush's :func:`flat_metrics` to ``log`` (a trainer's
    loggers) while the run goes on; with ``exchange``, how many verdicts other ranks
    reached too."""

    def __init__(self, log: Callable[[dict[str, float]], None], per_layer: bool = False,
                 exchange: VerdictExchange | None = None) -> None:
        self.log, self.per_layer, self.exchange = log, per_layer, exchange

    def on_flush(self, flush: Flush) -> None:
        if flush.last:  # the run is over: its loggers may be finalised
            return
        metrics = flat_metrics(flush.snapshot, flush.alarms, len(flush.verdicts),
                               limits=flush.limits, per_layer=self.per_layer, order=flush.order)
        if flush.guard_skipped is not None:
            metrics["normwatch/guard_skipped_steps"] = float(flush.guard_skipped)
        if self.exchange is not None:
            metrics["normwatch/remote_verdicts"] = float(len(self.exchange.remote))
        self.log(metrics)

    def on_exception(self, flush: Flush, exc: BaseException) -> None:
        pass

    def close(self) -> None:
        pass


def _summary(measured: Mapping[str, Mapping[str, float | int | None]], order: Sequence[str],
             prefix: str) -> dict[str, float]:
    def finite(field: str) -> dict[str, float]:
        return {name: float(v) for name, values in measured.items()
                if (v := values[field]) is not None and math.isfinite(v)}

    out: dict[str, float] = {}
    absmax, headroom, eps = finite("absmax"), finite("fp16_headroom"), finite("eps_dominance")
    if absmax:
        worst = max(absmax, key=absmax.__getitem__)
        out[f"{prefix}absmax_max"] = absmax[worst]
        position = list(order).index(worst) if worst in order else list(measured).index(worst)
        out[f"{prefix}absmax_max_layer"] = float(position)
    if headroom:
        out[f"{prefix}fp16_headroom_min"] = min(headroom.values())
    if eps:
        out[f"{prefix}eps_dominance_max"] = max(eps.values())
    out[f"{prefix}nonfinite_tokens"] = float(sum(
        (values["nonfinite"] or 0) + (values["out_nonfinite"] or 0)
        for values in measured.values()))
    return out
