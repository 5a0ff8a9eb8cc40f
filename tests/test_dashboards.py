"""Dashboards and alert rules against a real Prometheus scraping a live training run.

Needs Debian's ``prometheus`` and ``prometheus-pushgateway`` (``scripts/test`` installs
them); the tests skip where the binaries are absent.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import normwatch
from normwatch.demos.toymodel import TinyLM, lm_loss, synthetic_batch

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = json.loads((ROOT / "dashboards/grafana/normwatch.json").read_text())
RULES = yaml.safe_load((ROOT / "dashboards/prometheus/alerts.yml").read_text())
needs = pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("promtool")
                           is None, reason="prometheus not installed (scripts/test installs it)")


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in DASHBOARD["panels"] for t in p["targets"]]


def rule_exprs() -> list[str]:
    return [r["expr"] for g in RULES["groups"] for r in g["rules"]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read().decode())


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A training run with an exporter, scraped every second by a real Prometheus."""
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus not installed")
    tmp = tmp_path_factory.mktemp("prom")
    torch.manual_seed(0)
    model = TinyLM(dim=32, depth=2).half()  # fp16 with a drift: alarms, spikes and NaN data
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    w = normwatch.watch(model, opt, flush_every=1, prometheus_port=0,
                        report_dir=str(tmp / "r"), report_console=False, run_id="live-run")
    assert w.endpoint is not None and w.endpoint.port is not None
    prom_port = free_port()
    (tmp / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ROOT / "dashboards/prometheus/alerts.yml")],
        "scrape_configs": [{"job_name": "normwatch", "static_configs": [
            {"targets": [f"127.0.0.1:{w.endpoint.port}"]}]}],
    }))
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{prom_port}"
    try:
        gen = torch.Generator().manual_seed(0)
        deadline = time.monotonic() + 12
        step = 0
        while time.monotonic() < deadline:  # ~12 s of training, scraped every second
            step += 1
            model.residual_scale.mul_(1.08)
            tokens = synthetic_batch(gen)
            loss = lm_loss(model(tokens), tokens)
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss)
            time.sleep(0.1)
        assert _wait(base, "normwatch_step", 20)
        yield {"base": base, "watch": w, "port": w.endpoint.port, "tmp": tmp}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        w.close()


def _wait(base: str, query: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if query_result(base, query):
                return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def substitute(expr: str) -> str:
    return (expr.replace("$__rate_interval", "5s").replace("$__range", "1h")
            .replace("$run", "live-run").replace("$rank", ".*").replace("$layer", ".*"))


def query_result(base: str, expr: str) -> list[Any]:
    data = get(f"{base}/api/v1/query?query={urllib.parse.quote(expr)}")
    assert data["status"] == "success", data
    return list(data["data"]["result"])


def base_of(expr: str) -> str:
    """An alert expression without its trailing comparison: the data it is judged on."""
    return re.sub(r"\s*(>|<|>=|<=|==|!=)\s*[\d.]+\s*$", "", expr)


@needs
@pytest.mark.parametrize("expr", dashboard_exprs())
def test_every_dashboard_query_returns_data(live: dict[str, Any], expr: str) -> None:
    assert query_result(live["base"], substitute(expr)), expr


@needs
@pytest.mark.parametrize("expr", rule_exprs())
def test_every_alert_rule_has_data(live: dict[str, Any], expr: str) -> None:
    assert query_result(live["base"], base_of(expr)), base_of(expr)


@needs
def test_alerts_fire_for_the_overflowing_run(live: dict[str, Any]) -> None:
    # waits on the condition, with a bound generous enough for a loaded machine (rule
    # evaluation every second; a loaded CI machine was seen to need more than 15 s)
    assert _wait(live["base"], 'ALERTS{alertname="NormwatchFp16Overflow"}', 120)


@needs
def test_dashboard_variables_resolve(live: dict[str, Any]) -> None:
    for var in DASHBOARD["templating"]["list"][1:]:
        match = re.match(r"label_values\((.*), (\w+)\)$", var["query"]["query"])
        assert match, var
        series, label = match.groups()
        result = query_result(live["base"], substitute(series))
        assert {r["metric"][label] for r in result}, var["name"]


@needs
def test_promtool_checks(live: dict[str, Any], tmp_path: Path) -> None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{live['port']}/metrics").read().decode()
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    for args in (["check", "rules", str(ROOT / "dashboards/prometheus/alerts.yml")],
                 ["check", "config", str(ROOT / "dashboards/prometheus/prometheus.yml")]):
        result = subprocess.run(["promtool", *args], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


@needs
def test_dashboard_lint(live: dict[str, Any]) -> None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{live['port']}/metrics").read().decode()
    exported = set(re.findall(r"^(normwatch_\w+?)(?:\{| )", text, flags=re.M))
    assert DASHBOARD["templating"]["list"][0]["type"] == "datasource"
    for panel in DASHBOARD["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["id"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            expr = target["expr"]
            for rate in re.findall(r"rate\((.*?\])", expr):
                assert rate.endswith("[$__rate_interval]"), expr
            for match in re.finditer(r"normwatch_\w+_total", expr):
                before = expr[: match.start()]
                opened = before.rfind("(")
                assert re.search(r"(rate|increase)$", before[:opened]), \
                    f"counter outside rate()/increase(): {expr}"
            for name in re.findall(r"normwatch_\w+", expr):
                assert name in exported, f"{name} is not exported"
    for var in DASHBOARD["templating"]["list"][1:]:
        assert var["datasource"]["uid"] == "${datasource}"


@pytest.mark.skipif(shutil.which("prometheus-pushgateway") is None,
                    reason="prometheus-pushgateway not installed")
def test_push_to_a_real_pushgateway(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(["prometheus-pushgateway", f"--web.listen-address=127.0.0.1:{port}",
                             f"--persistence.file={tmp_path / 'pg'}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.RMSNorm(4))
        w = normwatch.watch(model, flush_every=1, report_dir=None, run_id="pushed-run")
        model(torch.randn(2, 4)).sum().backward()
        w.step(1.5)
        deadline = time.monotonic() + 15
        while True:
            try:
                w.push_metrics(f"127.0.0.1:{port}", job="normwatch-summary")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        assert re.search(r'normwatch_step\{.*job="normwatch-summary".*run_id="pushed-run".*\} 1',
                         text), text[:2000]
        assert 'normwatch_loss{' in text
        w.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
