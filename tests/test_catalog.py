"""The one table of statistics and everything derived from it."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from normwatch.catalog import (
    COLUMNS,
    MAX_COLUMNS,
    MIN_COLUMNS,
    PUBLIC,
    RAW,
    STATS,
    SUM_COLUMNS,
    TABLE,
    combine,
    decode_score,
    identity_row,
    layer_values,
    values,
)
from normwatch.records import LayerStats, Limits
from normwatch.report.document import HISTORY_FIELDS
from tests.factory import stats


def test_layer_stats_carries_exactly_the_public_statistics() -> None:
    numeric = [f.name for f in dataclasses.fields(LayerStats)
               if f.name not in ("name", "kind") and not f.name.endswith(("dtype", "autocast"))
               and f.name != "autocast_made"]  # host metadata, not device statistics
    assert sorted(numeric) == sorted(PUBLIC) and len(set(PUBLIC)) == len(PUBLIC)


def test_each_statistic_is_either_raw_with_a_reduction_or_derived() -> None:
    for s in TABLE:
        if s.source == "derived":
            assert s.reduce is None and s.derive is not None, s.name
        else:
            assert s.reduce in ("sum", "max", "min") and s.derive is None, s.name
    assert len(STATS) == len(TABLE)
    assert COLUMNS == SUM_COLUMNS + MAX_COLUMNS + MIN_COLUMNS
    assert set(RAW) == {s.name for s in TABLE if s.source != "derived"}
    assert identity_row(("tokens", "absmax", "rms_min")) == [0.0, -math.inf, math.inf]


def test_values_derive_from_the_combined_parts() -> None:
    raw = dict(zip(RAW, identity_row(), strict=True)) | {
        "calls": 2.0, "tokens": 10.0, "stats_tokens": 4.0, "rms_sum": 6.0, "absmax": 64.0}
    v = values(raw, Limits(fp16_limit=128.0))
    assert (v["rms_mean"], v["fp16_headroom"], v["tokens"], v["absmax"]) == (1.5, 2.0, 10, 64.0)
    assert isinstance(v["tokens"], int)
    assert v["rms_max"] is None and v["rms_min"] is None  # identities: nothing measured
    assert values(raw | {"stats_tokens": 0.0}, Limits())["rms_mean"] is None


def test_layer_values_adds_the_derived_non_fields() -> None:
    v = layer_values(stats(absmax=32.0), Limits(fp16_limit=64.0))
    assert v["fp16_headroom"] == 2.0 and v["absmax"] == 32.0
    assert layer_values(stats(absmax=None), Limits())["fp16_headroom"] is None


def test_shared_families_agree() -> None:
    families: dict[str, tuple[str, str]] = {}
    for s in TABLE:
        if s.metric is None:
            continue
        seen = families.setdefault(s.metric.name, (s.metric.type, s.metric.help))
        assert seen == (s.metric.type, s.metric.help), s.name


def test_report_history_is_what_the_table_marks() -> None:
    assert tuple(s.name for s in TABLE if s.history) == HISTORY_FIELDS
    assert "rms_mean" in HISTORY_FIELDS and "rms_sum" not in HISTORY_FIELDS


@pytest.mark.parametrize(("score", "expected"), [
    (0.0, None), (math.inf, None), (float(1 << 52) - (7 * (1 << 20) + 3), (7, 3))])
def test_first_event_scores_decode(score: float, expected: tuple[int, int] | None) -> None:
    assert decode_score(score) == expected


def test_combine_reduces_each_column_as_its_statistic_declares() -> None:
    """Against a plain loop over the declared reductions: sums added, a maximum or a
    minimum replaced only by a larger or smaller value (a NaN never replaces it; a NaN
    sum stays NaN), signed zeros kept, no rows giving the identities; RAW and COLUMNS."""
    gen = random.Random(7)
    special = [0.0, -0.0, 1.5, -2.0, math.inf, -math.inf, math.nan]
    for _ in range(200):
        rows = [{c: gen.choice(special) for c in RAW} for _ in range(gen.randint(0, 3))]
        for columns in (RAW, COLUMNS):
            want = dict(zip(columns, identity_row(columns), strict=True))
            for row in rows:
                for c in columns:
                    how, v = STATS[c].reduce, row[c]
                    if how == "sum":
                        want[c] = want[c] + v
                    elif (v > want[c]) if how == "max" else (v < want[c]):
                        want[c] = v
            got = combine(rows, columns)
            assert list(got) == list(columns)
            for c in columns:
                a, b = got[c], want[c]
                assert (math.isnan(a) and math.isnan(b)) or \
                    (a == b and math.copysign(1.0, a) == math.copysign(1.0, b)), (c, a, b)
