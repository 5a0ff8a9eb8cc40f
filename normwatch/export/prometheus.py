"""Prometheus metrics from host-side snapshots, the way ``prometheus_client`` does it.

    >>> registry.register(watch.collector)          # your registry, your exporter
    >>> normwatch.watch(model, prometheus_port=9464)  # or: serve 127.0.0.1:9464/metrics

:class:`NormwatchCollector` holds the metric state of one watch: :meth:`~NormwatchCollector.
update` folds a flush in (training thread), :meth:`~NormwatchCollector.collect` builds
fresh metric families from plain data (scrape thread; it never touches a tensor).
:class:`MetricsEndpoint` serves or pushes a collector from a private registry. The
per-layer families come from :data:`normwatch.catalog.TABLE`; alarm kinds, severities and
blames from :mod:`normwatch.records`. Counters are cumulative over the run and never
receive non-finite values; a layer's gauge keeps its last value while the layer is not
called or, for the full statistics, while only the sentinel tier ran. Every series carries
``run_id`` and ``rank``; per-layer series add ``layer`` and ``kind``.
"""

from __future__ import annotations

import math
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client import CollectorRegistry, push_to_gateway, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from normwatch.catalog import TABLE, Metric, layer_values
from normwatch.judge.depth import DepthProfile
from normwatch.pipeline import Flush
from normwatch.records import (
    ALARM_KINDS,
    BLAMES,
    SEVERITIES,
    Alarm,
    Limits,
    NormLayer,
    Snapshot,
    Verdict,
)

LAYER_METRICS: tuple[tuple[str, Metric], ...] = tuple(
    (s.name, s.metric) for s in TABLE if s.metric is not None)
"""``(statistic, family)`` for every per-layer family, in table order."""
_SPIKE_TRIGGERS = ("loss_spike", "nonfinite_loss")
_Key = tuple[str, ...]


@dataclass
class _State:
    """What the scrape thread reads; copied under a lock."""

    step: int = 0
    last_flush: float = 0.0
    flushes: int = 0
    loss: float | None = None
    depth_ratio: float | None = None
    grad_norm: float | None = None
    update_norm: float | None = None
    update_ratio: float | None = None
    gauges: dict[str, dict[_Key, float]] = field(default_factory=dict)
    """family -> (layer, label values) -> value."""
    counters: dict[str, dict[_Key, float]] = field(default_factory=dict)
    """family (per-layer counters, alarms, spikes) -> label values -> value."""
    nonfinite_losses: float = 0.0
    guard_skipped: float = 0.0

    def copy(self) -> _State:
        return replace(self, gauges={k: dict(v) for k, v in self.gauges.items()},
                       counters={k: dict(v) for k, v in self.counters.items()})


class NormwatchCollector(Collector):
    """The metrics of one watch (see the module docstring); register it on any registry."""

    def __init__(self, layers: Sequence[NormLayer], run_id: str, rank: int | None,
                 limits: Limits, version: str) -> None:
        self.run_id = run_id
        self.rank = "0" if rank is None else str(rank)
        self.limits = limits
        self.version = version
        self.kinds = {layer.name: layer.kind for layer in layers}
        self._lock = threading.Lock()
        counters: dict[str, dict[_Key, float]] = {
            "alarms": {(k, s): 0.0 for k in ALARM_KINDS for s in SEVERITIES},
            "loss_spikes": {(b,): 0.0 for b in BLAMES}}
        for _, metric in LAYER_METRICS:
            if metric.type == "counter":
                extra = tuple(v for _, v in metric.labels)
                counters.setdefault(metric.name, {}).update(
                    {(n, *extra): 0.0 for n in self.kinds})
        self._state = _State(counters=counters)
        self.across_ranks: Callable[[Flush], Flush] | None = None
        """With ``prometheus_aggregate``: the flush combined over every rank."""

    def on_flush(self, flush: Flush) -> None:
        """The watch's sink: fold ``flush`` in (combined over the ranks by
        :attr:`across_ranks` at regular flushes, which every rank reaches)."""
        if self.across_ranks is not None and flush.regular:
            flush = self.across_ranks(flush)
        self.update(flush.snapshot, flush.passed, flush.new_verdicts, flush.profile)
        if flush.guard_skipped is not None:
            with self._lock:
                self._state.guard_skipped = float(flush.guard_skipped)

    def on_exception(self, flush: Flush, exc: BaseException) -> None:
        pass

    def close(self) -> None:
        pass

    def update(self, snapshot: Snapshot, alarms: Iterable[Alarm] = (),
               verdicts: Iterable[Verdict] = (), profile: DepthProfile | None = None
               ) -> None:
        """Fold one flush in: gauges replaced, counters incremented; ``profile``: its
        depth profile."""
        with self._lock:
            s = self._state
            s.step, s.last_flush, s.flushes = snapshot.step, time.time(), s.flushes + 1
            for _, loss in snapshot.losses:
                if math.isfinite(loss):
                    s.loss = loss
                else:
                    s.nonfinite_losses += 1
            if profile is not None:
                s.depth_ratio = profile.ratio
            if snapshot.updates:  # the interval's largest: a one-step blow-up stays visible
                s.grad_norm, s.update_norm, s.update_ratio = (
                    max((v for v in values if v is not None and math.isfinite(v)),
                        default=None) for values in zip(
                        *((u.grad_norm, u.update_norm, u.update_ratio) for u in snapshot.updates),
                        strict=True))
            for name, stats in snapshot.layers.items():
                if not stats.seen:
                    continue
                measured = layer_values(stats, self.limits)
                for stat, metric in LAYER_METRICS:
                    value = measured[stat]
                    if value is None or not math.isfinite(value):
                        continue  # not measured: the gauge keeps its last value
                    key = (name, *(v for _, v in metric.labels))
                    if metric.type == "gauge":
                        s.gauges.setdefault(metric.name, {})[key] = float(value)
                    else:
                        family = s.counters[metric.name]
                        family[key] = family.get(key, 0.0) + float(value)
            for alarm in alarms:
                key = (alarm.kind, alarm.severity)
                s.counters["alarms"][key] = s.counters["alarms"].get(key, 0.0) + alarm.count
            for verdict in verdicts:
                if verdict.trigger in _SPIKE_TRIGGERS:
                    spikes = s.counters["loss_spikes"]
                    spikes[(verdict.blame,)] = spikes.get((verdict.blame,), 0.0) + 1

    def collect(self) -> Iterator[Any]:
        """Fresh metric families from the last flushes (scrape thread)."""
        with self._lock:
            state = self._state.copy()
        base = ["run_id", "rank"]
        ids = [self.run_id, self.rank]
        info = InfoMetricFamily("normwatch", "normwatch version and identity of this process.",
                                labels=base)
        info.add_metric(ids, {"version": self.version, "host": socket.gethostname()})
        yield info
        scalars: list[tuple[str, str, float | None]] = [
            ("normwatch_step", "Optimizer steps counted by normwatch.", state.step),
            ("normwatch_last_flush_timestamp_seconds",
             "Unix time of the last flush (alert when it stops moving).", state.last_flush),
            ("normwatch_fp16_limit", "The |x| alarm threshold (256: x^2 overflows fp16).",
             self.limits.fp16_limit),
            ("normwatch_loss", "Last finite loss passed to watch.step().", state.loss),
            ("normwatch_gradient_depth_ratio", "Hidden-state gradient RMS at the first norm / "
             "at the last (below 1: it decays toward the input).", state.depth_ratio),
            ("normwatch_optimizer_gradient_norm", "Largest global L2 norm of the gradients "
             "of an optimizer step in the last flush interval (watch_optimizer).",
             state.grad_norm),
            ("normwatch_optimizer_update_norm", "Largest L2 norm of the parameter change of "
             "an optimizer step in the last flush interval.", state.update_norm),
            ("normwatch_optimizer_update_ratio", "Largest update norm / parameter norm of an "
             "optimizer step in the last flush interval.", state.update_ratio),
        ]
        for name, help_, value in scalars:
            if value is not None:
                g = GaugeMetricFamily(name, help_, labels=base)
                g.add_metric(ids, value)
                yield g
        seen: set[str] = set()
        for _, metric in LAYER_METRICS:
            if metric.name in seen:
                continue
            seen.add(metric.name)
            if metric.type == "gauge":
                g = GaugeMetricFamily(f"normwatch_{metric.name}", metric.help,
                                      labels=[*base, "layer", "kind",
                                              *(k for k, _ in metric.labels)])
                for (layer, *extra), value in state.gauges.get(metric.name, {}).items():
                    g.add_metric([*ids, layer, self.kinds.get(layer, ""), *extra], value)
                yield g
            else:
                labels = [*base, "layer", *(k for k, _ in metric.labels)]
                yield _counter(f"normwatch_{metric.name}", metric.help, labels,
                               state.counters[metric.name], ids)
        yield _counter("normwatch_flushes", "Flushes (device-to-host copies).", base,
                       {(): state.flushes}, ids)
        yield _counter("normwatch_alarms", "Alarms emitted, by kind and severity.",
                       [*base, "kind", "severity"], state.counters["alarms"], ids)
        yield _counter("normwatch_loss_spikes", "Loss spikes and non-finite losses, by verdict.",
                       [*base, "blame"], state.counters["loss_spikes"], ids)
        yield _counter("normwatch_nonfinite_losses", "Non-finite losses.", base,
                       {(): state.nonfinite_losses}, ids)
        yield _counter("normwatch_guard_skipped_steps", "Optimizer steps the guard kept from "
                       "the weights (guard=True).", base, {(): state.guard_skipped}, ids)


def _counter(name: str, help_: str, labels: list[str], samples: dict[Any, float],
             ids: list[str]) -> CounterMetricFamily:
    """A counter family: one sample per label tuple (after the run_id/rank labels)."""
    family = CounterMetricFamily(name, help_, labels=labels)
    for key, value in samples.items():
        family.add_metric([*ids, *key], value)
    return family


class MetricsEndpoint:
    """Serves (HTTP, optionally TLS) or pushes one collector from a private registry."""

    def __init__(self, collector: NormwatchCollector, run_id: str, rank: int | None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(collector)
        self.grouping = {"run_id": run_id, "rank": "0" if rank is None else str(rank)}
        self.server: Any = None
        self.port: int | None = None

    def serve(self, port: int, addr: str = "127.0.0.1", certfile: str | None = None,
              keyfile: str | None = None) -> bool:
        """Start the HTTP endpoint; on failure warn once and return ``False``."""
        try:
            self.server, _ = start_http_server(port, addr=addr, registry=self.registry,
                                               certfile=certfile, keyfile=keyfile)
        except (OSError, ValueError) as exc:
            warnings.warn(f"normwatch: cannot serve Prometheus metrics on {addr}:{port} "
                          f"({type(exc).__name__}: {exc}); training continues without the "
                          "exporter", RuntimeWarning, stacklevel=4)
            return False
        self.port = int(self.server.server_port)
        return True

    def push(self, gateway: str, job: str = "normwatch", timeout: float = 10.0) -> None:
        """Push the current metrics to a Pushgateway, grouped by ``run_id`` (and rank)."""
        push_to_gateway(gateway, job=job, registry=self.registry, timeout=timeout,
                        grouping_key=self.grouping)

    def close(self) -> None:
        """Stop serving (harmless twice)."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
