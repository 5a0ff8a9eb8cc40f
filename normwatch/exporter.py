"""Prometheus metrics from host-side snapshots: a custom collector on a private registry.

    >>> w = normwatch.watch(model, prometheus_port=9464)    # serves 127.0.0.1:9464/metrics

The scrape thread only reads plain data copied at the last flush; it never touches a
tensor. Counters are cumulative over the run and never receive non-finite values; gauges
of a layer not measured in the last interval keep their last value. Every series carries
``run_id`` and ``rank``; per-layer series add ``layer`` and ``kind``. Metric reference:
the README's "Prometheus" section. A gauge keeps its last value while its layer is not
called or, for the full statistics, while only the sentinel tier ran.
"""

from __future__ import annotations

import math
import socket
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, push_to_gateway, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from normwatch.alarms import Alarm
from normwatch.blame import Verdict
from normwatch.discovery import NormLayer
from normwatch.snapshot import Snapshot

ALARM_KINDS = ("fp16_overflow", "fp16_headroom", "nonfinite", "eps_dominance", "common_mode",
               "dtype_mismatch", "output_mismatch")
SEVERITIES = ("info", "warning", "critical")
BLAMES = ("normalization", "not_normalization", "inconclusive")
GAUGES = (  # (metric suffix, LayerStats field, help)
    ("layer_absmax", "absmax", "Max |x| of the layer's input over the last interval."),
    ("layer_rms_mean", "rms_mean", "Mean over tokens of the input's per-token RMS."),
    ("layer_rms_max", "rms_max", "Max over tokens of the input's per-token RMS."),
    ("layer_eps_dominance_ratio", "eps_dominance",
     "Max over tokens of eps / (s + eps), s = mean square (RMSNorm) or variance."),
    ("layer_common_mode_ratio", "common_mode_max", "Max over tokens of |mean| / RMS."),
    ("layer_output_absmax", "out_absmax", "Max |y| of the layer's output."),
)
LAYER_GAUGE_HELP = {suffix: help_ for suffix, _, help_ in GAUGES} | {
    "layer_fp16_headroom_ratio":
        "fp16 limit / max |x|: below 1 the layer's input overflows x^2 in fp16."}


@dataclass
class _State:
    """What the scrape thread reads; replaced wholesale under a lock at each flush."""

    step: int = 0
    last_flush: float = 0.0
    flushes: int = 0
    loss: float | None = None
    layers: dict[str, dict[str, float]] = field(default_factory=dict)
    tokens: dict[str, float] = field(default_factory=dict)
    nonfinite: dict[tuple[str, str], float] = field(default_factory=dict)
    overflow: dict[str, float] = field(default_factory=dict)
    alarms: dict[tuple[str, str], float] = field(default_factory=dict)
    spikes: dict[str, float] = field(default_factory=dict)
    nonfinite_losses: float = 0.0


class Exporter:
    """Holds the metric state of one watch and (optionally) serves it over HTTP."""

    def __init__(self, layers: Sequence[NormLayer], run_id: str, rank: int | None,
                 fp16_limit: float, version: str) -> None:
        self.run_id = run_id
        self.rank = "0" if rank is None else str(rank)
        self.fp16_limit = fp16_limit
        self.version = version
        self.kinds = {layer.name: layer.kind for layer in layers}
        self._lock = threading.Lock()
        self._state = _State(
            nonfinite={(n, w): 0.0 for n in self.kinds for w in ("input", "output")},
            overflow=dict.fromkeys(self.kinds, 0.0), tokens=dict.fromkeys(self.kinds, 0.0),
            alarms={(k, s): 0.0 for k in ALARM_KINDS for s in SEVERITIES},
            spikes=dict.fromkeys(BLAMES, 0.0),
        )
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_Collector(self))
        self.server: Any = None
        self.port: int | None = None

    # -- updates (training thread, at flush) ----------------------------------------------

    def update(self, snapshot: Snapshot, alarms: Iterable[Alarm],
               verdicts: Iterable[Verdict]) -> None:
        """Fold one flush into the state: gauges replaced, counters incremented."""
        with self._lock:
            s = self._state
            s.step, s.last_flush, s.flushes = snapshot.step, time.time(), s.flushes + 1
            for _, loss in snapshot.losses:
                if math.isfinite(loss):
                    s.loss = loss
                else:
                    s.nonfinite_losses += 1
            for name, stats in snapshot.layers.items():
                if not stats.seen:
                    continue
                gauges = {suffix: getattr(stats, attr) for suffix, attr, _ in GAUGES}
                if stats.absmax:
                    gauges["layer_fp16_headroom_ratio"] = self.fp16_limit / stats.absmax
                # statistics the sentinel tier did not measure keep their last value
                s.layers.setdefault(name, {}).update(
                    {k: v for k, v in gauges.items() if v is not None and math.isfinite(v)})
                s.tokens[name] += stats.tokens
                s.nonfinite[(name, "input")] += stats.nonfinite
                s.nonfinite[(name, "output")] += stats.out_nonfinite
                s.overflow[name] += stats.fp16_overflow_tokens
            for alarm in alarms:
                key = (alarm.kind, alarm.severity)
                s.alarms[key] = s.alarms.get(key, 0.0) + alarm.count
            for verdict in verdicts:
                if verdict.trigger == "loss_spike" or verdict.trigger == "nonfinite_loss":
                    s.spikes[verdict.blame] = s.spikes.get(verdict.blame, 0.0) + 1

    # -- serving ------------------------------------------------------------------------------

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
                        grouping_key={"run_id": self.run_id, "rank": self.rank})

    def close(self) -> None:
        """Stop serving (harmless twice)."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    # -- collection (scrape thread) ----------------------------------------------------------

    def families(self) -> Iterator[Any]:
        with self._lock:
            s = self._state
            layers = {k: dict(v) for k, v in s.layers.items()}
            state = _State(s.step, s.last_flush, s.flushes, s.loss, layers, dict(s.tokens),
                           dict(s.nonfinite), dict(s.overflow), dict(s.alarms), dict(s.spikes),
                           s.nonfinite_losses)
        base = ["run_id", "rank"]
        ids = [self.run_id, self.rank]
        info = InfoMetricFamily("normwatch", "normwatch version and identity of this process.",
                                labels=base)
        info.add_metric(ids, {"version": self.version, "host": socket.gethostname()})
        yield info
        for name, help_, value in (
            ("normwatch_step", "Optimizer steps counted by normwatch.", state.step),
            ("normwatch_last_flush_timestamp_seconds",
             "Unix time of the last flush (alert when it stops moving).", state.last_flush),
            ("normwatch_fp16_limit", "The |x| alarm threshold (256: x^2 overflows fp16).",
             self.fp16_limit),
        ):
            g = GaugeMetricFamily(name, help_, labels=base)
            g.add_metric(ids, value)
            yield g
        if state.loss is not None:
            g = GaugeMetricFamily("normwatch_loss", "Last finite loss passed to watch.step().",
                                  labels=base)
            g.add_metric(ids, state.loss)
            yield g
        layer_labels = [*base, "layer", "kind"]
        for suffix, help_ in LAYER_GAUGE_HELP.items():
            g = GaugeMetricFamily(f"normwatch_{suffix}", help_, labels=layer_labels)
            for name, values in state.layers.items():
                if suffix in values:
                    g.add_metric([*ids, name, self.kinds.get(name, "")], values[suffix])
            yield g
        yield from self._counters(state, ids, base)

    def _counters(self, s: _State, ids: list[str], base: list[str]) -> Iterator[Any]:
        per_layer = [*base, "layer"]
        yield _counter("normwatch_flushes", "Flushes (device-to-host copies).", base,
                       {(): s.flushes}, ids)
        yield _counter("normwatch_tokens", "Tokens measured per layer.", per_layer,
                       {(n,): v for n, v in s.tokens.items()}, ids)
        yield _counter("normwatch_nonfinite_tokens",
                       "Tokens holding NaN/inf in a layer's input or output.",
                       [*per_layer, "where"], s.nonfinite, ids)
        yield _counter("normwatch_fp16_limit_tokens",
                       "Tokens whose max |x| exceeded the fp16 limit.", per_layer,
                       {(n,): v for n, v in s.overflow.items()}, ids)
        yield _counter("normwatch_alarms", "Alarms emitted, by kind and severity.",
                       [*base, "kind", "severity"], s.alarms, ids)
        yield _counter("normwatch_loss_spikes", "Loss spikes and non-finite losses, by verdict.",
                       [*base, "blame"], {(b,): v for b, v in s.spikes.items()}, ids)
        yield _counter("normwatch_nonfinite_losses", "Non-finite losses.", base,
                       {(): s.nonfinite_losses}, ids)


def _counter(name: str, help_: str, labels: list[str], values: Mapping[Any, float],
             ids: list[str]) -> CounterMetricFamily:
    """A counter family: one sample per label tuple (after the run_id/rank labels)."""
    family = CounterMetricFamily(name, help_, labels=labels)
    for key, value in values.items():
        family.add_metric([*ids, *key], value)
    return family


class _Collector(Collector):
    def __init__(self, exporter: Exporter) -> None:
        self.exporter = exporter

    def collect(self) -> Iterator[Any]:
        return self.exporter.families()
