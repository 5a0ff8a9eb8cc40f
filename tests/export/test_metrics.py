"""Flat logger metrics: the catalog's logged statistics, finite only, the user's limits."""

from __future__ import annotations

import math

from normwatch.catalog import TABLE
from normwatch.export.metrics import flat_metrics
from normwatch.records import Alarm, Limits
from tests.factory import snapshot, stats


def test_logged_statistics_per_layer_with_headroom_against_the_limit() -> None:
    snap = snapshot(5, stats("a", absmax=50.0), stats("b", calls=0))
    out = flat_metrics(snap, limits=Limits(fp16_limit=100.0), per_layer=True)
    logged = {s.name for s in TABLE if s.logged}
    assert {k.split("/")[2] for k in out if k.startswith("normwatch/a/")} == logged
    assert out["normwatch/a/fp16_headroom"] == 2.0
    assert out["normwatch/a/absmax"] == 50.0
    assert not [k for k in out if k.startswith("normwatch/b/")]  # not called: left out
    assert flat_metrics(snap, per_layer=True)["normwatch/a/fp16_headroom"] == 256.0 / 50.0


def test_only_finite_numbers_and_cumulative_alarm_counts() -> None:
    snap = snapshot(5, stats("a", absmax=None, rms_mean=None, out_absmax=math.inf))
    alarms = [Alarm("nonfinite", "critical", "a", 5, 1.0, 0.0, "x", count=3),
              Alarm("eps_dominance", "info", "a", 5, 0.1, 0.01, "y")]
    out = flat_metrics(snap, alarms, verdicts=2, prefix="nw.", per_layer=True)
    assert all(math.isfinite(v) for v in out.values())
    assert "nw.a/absmax" not in out and "nw.a/out_absmax" not in out
    assert "nw.a/fp16_headroom" not in out
    assert (out["nw.alarms/critical"], out["nw.alarms/info"], out["nw.alarms/warning"]) == (
        3.0, 1.0, 0.0)
    assert out["nw.verdicts"] == 2.0


def test_the_default_is_a_handful_of_worst_layer_summaries() -> None:
    layers = [stats(f"blocks.{i}.norm", absmax=float(10 + i % 7), eps_dominance=1e-5 * i,
                    nonfinite=i % 2, out_nonfinite=1) for i in range(60)]
    out = flat_metrics(snapshot(5, *layers), limits=Limits(fp16_limit=64.0),
                       order=[s.name for s in reversed(layers)])
    assert set(out) == {f"normwatch/{k}" for k in (
        "absmax_max", "absmax_max_layer", "fp16_headroom_min", "eps_dominance_max",
        "nonfinite_tokens", "alarms/info", "alarms/warning", "alarms/critical", "verdicts")}
    assert out["normwatch/absmax_max"] == 16.0
    assert out["normwatch/absmax_max_layer"] == 59 - 6  # blocks.6: the first 16, reversed order
    assert out["normwatch/fp16_headroom_min"] == 64.0 / 16.0
    assert out["normwatch/eps_dominance_max"] == 1e-5 * 59
    assert out["normwatch/nonfinite_tokens"] == 30 + 60
