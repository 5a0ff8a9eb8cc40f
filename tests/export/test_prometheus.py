"""The Prometheus exporter: collector contents, serving, TLS, port conflicts, aggregation."""

from __future__ import annotations

import math
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

import normwatch


def scrape(port: int, scheme: str = "http", context: ssl.SSLContext | None = None) -> str:
    with urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}/metrics", timeout=10,
                                context=context) as r:
        return str(r.read().decode())


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in ("run_id", "host", "version")))
            out[(s.name, labels)] = s.value
    return out


def model_and_watch(**options: object) -> tuple[nn.Module, normwatch.Watch]:
    model = nn.Sequential()
    model.add_module("lin", nn.Linear(8, 8))
    model.add_module("norm", nn.LayerNorm(8))
    options = {"flush_every": 1, "report_dir": None, "prometheus_port": 0, **options}
    return model, normwatch.watch(model, **options)


def test_metrics_follow_the_flushes_and_counters_never_see_nan() -> None:
    model, w = model_and_watch(run_id="run-a", stats_every=1)
    assert w.endpoint is not None and w.endpoint.port
    try:
        model(torch.randn(4, 8) * 300).sum().backward()
        w.step(torch.tensor(2.5))
        first = samples(scrape(w.endpoint.port))
        layer = (("kind", "layernorm"), ("layer", "norm"), ("rank", "0"))
        assert first[("normwatch_layer_absmax", layer)] == pytest.approx(
            w.last_snapshot.layers["norm"].absmax)  # type: ignore[union-attr]
        assert first[("normwatch_layer_fp16_headroom_ratio", layer)] < 1
        assert first[("normwatch_step", (("rank", "0"),))] == 1
        assert first[("normwatch_loss", (("rank", "0"),))] == 2.5
        assert first[("normwatch_fp16_limit_tokens_total", (("layer", "norm"), ("rank", "0")))] == 4
        assert first[("normwatch_alarms_total", (("kind", "fp16_overflow"), ("rank", "0"),
                                                 ("severity", "info")))] == 1
        assert first[("normwatch_alarms_total", (("kind", "nonfinite"), ("rank", "0"),
                                                 ("severity", "critical")))] == 0
        model(torch.full((4, 8), float("nan"))).sum().backward()
        w.step(torch.tensor(float("nan")))
        second = samples(scrape(w.endpoint.port))
        assert second[("normwatch_nonfinite_tokens_total",
                       (("layer", "norm"), ("rank", "0"), ("where", "input")))] == 4  # 4 tokens
        assert second[("normwatch_loss", (("rank", "0"),))] == 2.5  # last finite loss
        assert second[("normwatch_nonfinite_losses_total", (("rank", "0"),))] == 1
        assert all(math.isfinite(v) for v in second.values())
        info = next(f for f in text_string_to_metric_families(scrape(w.endpoint.port))
                    if f.name in ("normwatch", "normwatch_info"))
        assert info.samples[0].labels["run_id"] == "run-a"
    finally:
        w.close()


def test_gradient_sites_and_optimizer_steps_are_separate_series() -> None:
    model, w = model_and_watch(stats_every=1, flush_every=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w.watch_optimizer(opt)
    assert w.endpoint is not None and w.endpoint.port
    try:
        for scale in (1.0, 50.0):  # the second step's gradient is 50x the first's
            model(torch.randn(4, 8)).mul(scale).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
            w.step()
        got = samples(scrape(w.endpoint.port))
        stats = w.last_snapshot.layers["norm"]  # type: ignore[union-attr]
        layer = (("kind", "layernorm"), ("layer", "norm"), ("rank", "0"))
        for where, value in (("output", stats.grad_out_rms), ("input", stats.grad_in_rms),
                             ("hidden", stats.grad_hidden_rms)):
            assert value is not None and got[("normwatch_layer_gradient_rms",
                                              (*layer, ("where", where)))] == pytest.approx(value)
        assert stats.grad_out_rms != stats.grad_in_rms  # three distinct series, not one
        updates = w.last_snapshot.updates  # type: ignore[union-attr]
        rank = (("rank", "0"),)
        assert got[("normwatch_optimizer_gradient_norm", rank)] == pytest.approx(
            max(u.grad_norm for u in updates)) == pytest.approx(updates[1].grad_norm)
        assert got[("normwatch_optimizer_update_norm", rank)] == pytest.approx(
            updates[1].update_norm)
        assert got[("normwatch_optimizer_update_ratio", rank)] == pytest.approx(
            max(u.update_norm / u.param_norm for u in updates))
    finally:
        w.close()


def test_binds_to_loopback_and_stops_on_close() -> None:
    _, w = model_and_watch()
    assert w.endpoint is not None and w.endpoint.server is not None
    assert w.endpoint.server.server_address[0] == "127.0.0.1"
    port = w.endpoint.port
    assert port is not None and "normwatch_step" in scrape(port)
    w.close()
    with pytest.raises(urllib.error.URLError):
        scrape(port)


def test_port_conflict_warns_and_training_goes_on() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.warns(RuntimeWarning, match=f"cannot serve Prometheus metrics on "
                          f"127.0.0.1:{port}"):
            model, w = model_and_watch(prometheus_port=port)
        assert w.endpoint is None  # no handle to a server that is not there
        model(torch.randn(2, 8)).sum().backward()
        assert w.step() is not None  # still measuring
        w.close()


def test_bad_exporter_options() -> None:
    with pytest.raises(normwatch.ConfigError, match="'prometheus_port' must be <= 65535"):
        normwatch.watch(nn.LayerNorm(4), prometheus_port=70000)
    with pytest.raises(normwatch.ConfigError, match="'prometheus_certfile' and "
                       "'prometheus_keyfile' go together"):
        normwatch.watch(nn.LayerNorm(4), prometheus_port=0, prometheus_certfile="c.pem")


@pytest.mark.skipif(subprocess.run(["which", "openssl"], capture_output=True).returncode != 0,
                    reason="openssl not installed")
def test_tls_options_pass_through(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    _, w = model_and_watch(prometheus_certfile=str(cert), prometheus_keyfile=str(key))
    try:
        assert w.endpoint is not None and w.endpoint.port is not None
        context = ssl.create_default_context(cafile=str(cert))
        context.check_hostname = False
        assert "normwatch_step" in scrape(w.endpoint.port, "https", context)
        with pytest.raises(OSError):  # plain HTTP is refused (reset or URLError)
            scrape(w.endpoint.port)
    finally:
        w.close()


def test_the_collector_registers_on_a_user_registry_and_serves_with_their_exporter() -> None:
    from prometheus_client import start_http_server

    model, w = model_and_watch(prometheus_port=None, run_id="mine", fp16_limit=100.0)
    assert w.endpoint is None  # nothing served by normwatch itself
    for step in range(3):
        model(torch.randn(4, 8) * (step + 1)).sum().backward()
        w.step(torch.tensor(1.5))
    registry = CollectorRegistry()
    registry.register(w.collector)  # replays the flushes kept so far
    server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        got = samples(scrape(server.server_port))
    finally:
        server.shutdown()
        server.server_close()
        w.close()
    layer = (("kind", "layernorm"), ("layer", "norm"), ("rank", "0"))
    assert got[("normwatch_step", (("rank", "0"),))] == 3
    assert got[("normwatch_flushes_total", (("rank", "0"),))] == 3
    assert got[("normwatch_tokens_total", (("layer", "norm"), ("rank", "0")))] == 12
    assert got[("normwatch_fp16_limit", (("rank", "0"),))] == 100.0
    absmax = got[("normwatch_layer_absmax", layer)]
    assert got[("normwatch_layer_fp16_headroom_ratio", layer)] == pytest.approx(100.0 / absmax)
    assert absmax == pytest.approx(w.last_snapshot.layers["norm"].absmax)  # type: ignore[union-attr]


def test_label_values_come_from_the_records_vocabularies() -> None:
    from normwatch.records import ALARM_KINDS, BLAMES, SEVERITIES

    _, w = model_and_watch(prometheus_port=None)
    text = generate_latest(_registry(w)).decode()
    w.close()
    alarms = {(s.labels["kind"], s.labels["severity"]) for f in
              text_string_to_metric_families(text) for s in f.samples
              if s.name == "normwatch_alarms_total"}
    assert alarms == {(k, s) for k in ALARM_KINDS for s in SEVERITIES}
    blames = {s.labels["blame"] for f in text_string_to_metric_families(text)
              for s in f.samples if s.name == "normwatch_loss_spikes_total"}
    assert blames == set(BLAMES)


def _registry(w: normwatch.Watch) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(w.collector)
    return registry
