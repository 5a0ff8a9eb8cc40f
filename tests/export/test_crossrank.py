"""Across ranks: raw statistics combined with the declared reductions, then derived.

Two real gloo ranks each measure their own half of the data; every statistic of the
combined result must equal what one process measures on both halves, and the values
that have a closed form must equal a float64 reference of the concatenated inputs.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

import normwatch
from normwatch.catalog import PUBLIC, RAW, combine
from normwatch.export.crossrank import VerdictExchange, combine_ranks
from normwatch.measure.measurement import Measurement
from normwatch.measure.model.discovery import iter_norm_modules
from normwatch.records import Limits, Verdict
from tests.factory import two_ranks

WIDTH = 16


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.RMSNorm(WIDTH, eps=1e-3))


def rank_input(rank: int) -> torch.Tensor:
    """Each rank's batch: different scales, and every statistic has something to count
    (an overflowing token, an eps-dominated one, a common-mode one, a NaN on rank 1)."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(6 + 2 * rank, WIDTH, generator=g) * (1 + 4 * rank)
    x[0] = 300.0 * (rank + 1)              # past the fp16 limit
    x[1] = 1e-4                            # eps dominates (RMSNorm: mean square << eps)
    x[2] = 5.0 + 0.1 * torch.randn(WIDTH, generator=g)  # common mode
    if rank == 1:
        x[3, 4] = math.nan
    return x


def measure(inputs: list[torch.Tensor]) -> tuple[Measurement, list[dict[str, float]]]:
    """One step of ``model`` over ``inputs`` (one norm call each), read out raw."""
    net = model()
    m = Measurement(iter_norm_modules(net), Limits())
    for x in inputs:
        net[1](x)  # the norm itself: its input is exactly x
    rows, _ = m.read()
    m.close()
    return m, rows


def _worker(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    m, rows = measure([rank_input(rank)])
    combined = m.snapshot(combine_ranks(rows), 1, 1)
    # the same through a watch: what Prometheus exports with prometheus_aggregate=True
    net = model()
    w = normwatch.watch(net, prometheus_aggregate=True, flush_every=1, stats_every=1,
                        report_dir=None, rank=rank)
    net[1](rank_input(rank))
    w.step()
    registry = CollectorRegistry()
    registry.register(w.collector)
    exported = {s.name: s.value for f in text_string_to_metric_families(
        generate_latest(registry).decode()) for s in f.samples if s.labels.get("layer") == "1"}
    w.close()
    remote = VerdictExchange().exchange(
        [Verdict("exception", 3, "normalization", None, None, ())] if rank == 1 else [], 3)
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "stats": dataclasses.asdict(combined.layers["1"]), "exported": exported,
        "remote": remote}))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    return two_ranks(_worker, tmp_path_factory.mktemp("ranks"))


def test_every_statistic_equals_the_concatenated_inputs(ranks: list[dict[str, object]]
                                                        ) -> None:
    m, rows = measure([rank_input(0), rank_input(1)])
    alone = dataclasses.asdict(m.snapshot(rows, 1, 1).layers["1"])
    for rank in ranks:
        got = rank["stats"]
        assert isinstance(got, dict)
        for name in PUBLIC:
            if alone[name] is None:  # gradients: no backward here
                assert got[name] is None, name
                continue
            assert got[name] == pytest.approx(alone[name], rel=1e-9), name


def test_combined_values_match_a_float64_reference(ranks: list[dict[str, object]]) -> None:
    x = torch.cat([rank_input(0), rank_input(1)]).double()
    finite = x[torch.isfinite(x).all(1)]
    rms = finite.pow(2).mean(1).sqrt()
    got = ranks[0]["stats"]
    assert isinstance(got, dict)
    assert got["tokens"] == x.shape[0] and got["calls"] == 2
    assert got["nonfinite"] == 1 and got["finite_tokens"] == x.shape[0] - 1
    assert got["absmax"] == pytest.approx(float(finite.abs().max()), rel=1e-6)
    assert got["fp16_overflow_tokens"] == int((finite.abs().amax(1) > 256).sum())
    assert got["rms_mean"] == pytest.approx(float(rms.mean()), rel=1e-5)
    assert got["rms_min"] == pytest.approx(float(rms.min()), rel=1e-5)
    assert got["rms_max"] == pytest.approx(float(rms.max()), rel=1e-5)
    ratio = 1e-3 / (finite.pow(2).mean(1) + 1e-3)
    assert got["eps_dominance"] == pytest.approx(float(ratio.max()), rel=1e-4)
    assert got["eps_dominated_tokens"] == int((ratio > 0.01).sum())
    common = finite.mean(1).abs() / rms
    assert got["common_mode_tokens"] == int((common > 0.9).sum())


def test_prometheus_exports_the_combined_mean_not_one_ranks(ranks: list[dict[str, object]]
                                                            ) -> None:
    x = torch.cat([rank_input(0), rank_input(1)]).double()
    rms = x[torch.isfinite(x).all(1)].pow(2).mean(1).sqrt()
    for rank in ranks:
        exported = rank["exported"]
        assert isinstance(exported, dict)
        assert exported["normwatch_layer_rms_mean"] == pytest.approx(float(rms.mean()), rel=1e-5)
        assert exported["normwatch_tokens_total"] == x.shape[0]
        assert exported["normwatch_layer_absmax"] == pytest.approx(600.0)


def test_verdicts_reach_the_other_rank(ranks: list[dict[str, object]]) -> None:
    assert ranks[0]["remote"] == [[1, "normalization", 3]]
    assert ranks[1]["remote"] == []


def test_combine_without_a_process_group_is_the_identity() -> None:
    rows = [dict.fromkeys(RAW, 1.0)]
    assert combine_ranks(rows) == rows
    assert VerdictExchange().exchange([], 1) == []


def test_combine_uses_each_columns_reduction() -> None:
    a = dict.fromkeys(RAW, 1.0) | {"absmax": 5.0, "rms_min": 0.5, "tokens": 3.0}
    b = dict.fromkeys(RAW, 2.0) | {"absmax": 4.0, "rms_min": 0.7, "tokens": 4.0}
    c = combine([a, b])
    assert (c["absmax"], c["rms_min"], c["tokens"], c["rms_sum"]) == (5.0, 0.5, 7.0, 3.0)
