"""The accumulator: staged calls, the fold, the staging cap."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from normwatch.catalog import KEY_STRIDE
from normwatch.measure.backends import choose
from normwatch.measure.backends.torchops import reduce_call
from normwatch.measure.state.accumulator import Accumulator
from normwatch.measure.state.rows import CallRows
from normwatch.records import Limits

BACKENDS = partial(choose, kernel="auto")
"""Each device's backend, as a watch at defaults chooses."""


def some_calls(n: int) -> list[CallRows]:
    g = torch.Generator().manual_seed(0)
    calls = []
    for i in range(n):
        x = torch.randn(4 + i % 3, 16, generator=g) * (1 + 100 * (i % 5 == 0))
        if i == 7:
            x[1, 2] = float("nan")
        calls.append(reduce_call(x, torch.randn_like(x), "rmsnorm", 1e-6, i % 2 == 0, i % 3,
                                 float((1 + i // 4) * KEY_STRIDE + i % 4)))
    return calls


def test_staging_beyond_the_cap_folds_early_with_the_same_result() -> None:
    at_once = Accumulator(3, BACKENDS, Limits(), max_staged_tokens=1 << 20)
    capped = Accumulator(3, BACKENDS, Limits(), max_staged_tokens=20)
    for call in some_calls(30):
        at_once.stage(call)
        capped.stage(call)
        assert sum(c.hi.shape[0] for c in capped._staged) < 20  # folded as it went
    assert len(at_once._staged) == 30
    want, _ = at_once.read()
    got, _ = capped.read()
    for w, g in zip(want, got, strict=True):
        assert g == pytest.approx(w, rel=1e-6)
    assert got[1]["nonfinite"] == 1 and got[1]["first_arrived_score"] > 0  # call 7: row 1


def test_reset_drops_staged_calls() -> None:
    acc = Accumulator(3, BACKENDS)
    for call in some_calls(4):
        acc.stage(call)
    acc.reset()
    rows, _ = acc.read()
    assert all(r["finite_tokens"] == 0 and r["absmax"] == -float("inf") for r in rows)
