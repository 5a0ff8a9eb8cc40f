"""The host-side ring of recent flushes."""

from __future__ import annotations

from normwatch.judge.history import History, first_nonfinite
from normwatch.records import FirstNonfinite
from tests.factory import snapshot, stats


def test_keeps_the_last_flushes_oldest_first() -> None:
    history = History(size=3)
    for step in range(1, 6):
        history.append(snapshot(step * 10, stats()), [])
    assert len(history) == 3
    assert [r.snapshot.step for r in history] == [30, 40, 50]
    assert [r.snapshot.step for r in history.records(since_step=40)] == [40, 50]


def test_series_skips_flushes_where_the_layer_was_not_called() -> None:
    history = History()
    history.append(snapshot(10, stats(absmax=1.0)), [])
    history.append(snapshot(20, stats(calls=0, absmax=None)), [])
    history.append(snapshot(30, stats(absmax=3.0)), [])
    assert [(step, s.absmax) for step, s in history.series("blocks.0.norm")] == [(10, 1.0),
                                                                                 (30, 3.0)]
    assert history.series("no.such.layer") == []


def test_first_nonfinite_is_the_earliest_recorded() -> None:
    history = History()
    early = FirstNonfinite(12, "blocks.1.norm", 1, "input")
    later = FirstNonfinite(25, "blocks.0.norm", 0, "norm")
    for step, first in ((10, None), (20, early), (30, later)):
        history.append(snapshot(step, stats(), first_nonfinite=first), [])
    assert first_nonfinite(history.records()) == early
    assert first_nonfinite(history.records(since_step=30)) == later
    assert first_nonfinite([]) is None
