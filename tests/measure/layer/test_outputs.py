"""The output check reads a few dozen rows of each call (the largest |x|, the smallest
range, some spread evenly) and still finds the faults it exists for: a norm whose own
arithmetic overflows on its largest token, a misplaced eps on its smallest token, a
wrong dimension anywhere; eager and compiled alike."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import normwatch
from normwatch.measure.model.reference import CHECKED, checked_rows


class Faulty(nn.Module):
    """An RMSNorm (weight 1.5) with one planted fault."""

    def __init__(self, d: int, fault: str) -> None:
        super().__init__()
        self.eps = 1e-5
        self.weight = nn.Parameter(torch.full((d,), 1.5))
        self.fault = fault

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ms = x.pow(2).mean(-1, keepdim=True)
        if self.fault == "eps":  # eps outside the root: wrong only where ms ~ eps
            y = x / (ms.sqrt() + self.eps)
        elif self.fault == "overflow":  # x^2 in fp16: 0 out where |x| > 256
            y = x * torch.rsqrt(x.half().pow(2).float().mean(-1, keepdim=True) + self.eps)
        elif self.fault == "dim":
            y = x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + self.eps)
        else:
            y = x * torch.rsqrt(ms + self.eps)
        return self.weight * y


def batch(planted: str) -> torch.Tensor:
    x = torch.randn(4, 300, 32, generator=torch.Generator().manual_seed(0))
    if planted == "big":
        x[2, 217] *= 400.0  # one token past the fp16 square limit
    if planted == "tiny":
        x[1, 33] *= 1e-4  # one token whose mean square is near eps
    return x


def mismatch_of(fault: str, planted: str, compiled: bool = False) -> float:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Identity(), Faulty(32, fault))
    normwatch.register_norm(Faulty, kind="rmsnorm")
    try:
        w = normwatch.watch(net, flush_every=1, report_dir=None, gradients=False)
        run = torch.compile(net, fullgraph=True) if compiled else net
        run(batch(planted))
        snap = w.step()
        w.close()
    finally:
        normwatch.unregister_norm(Faulty)
    assert snap is not None
    value = snap.layers["1"].output_mismatch
    assert value is not None
    return value


def full_mismatch(fault: str, planted: str) -> float:
    """Float64, over every token."""
    x = batch(planted)
    y = Faulty(32, fault)(x).double().reshape(-1, 32)
    xd = x.double().reshape(-1, 32)
    ref = 1.5 * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)
    err = torch.linalg.vector_norm(y - ref, dim=1) / torch.linalg.vector_norm(ref, dim=1)
    return float(err.max().detach())


@pytest.mark.parametrize(("fault", "planted"), [("eps", "tiny"), ("overflow", "big"),
                                                ("dim", "none"), ("none", "none")])
def test_the_checked_rows_find_the_worst_token(fault: str, planted: str) -> None:
    want = full_mismatch(fault, planted)
    got = mismatch_of(fault, planted)
    if fault == "none":
        assert got < 1e-5 and want < 1e-6
    elif fault == "dim":  # every token is wrong, the sample's worst nearly the worst
        assert 0.5 * want < got <= want * (1 + 1e-4)
    else:  # one token of 1200 is wrong: the one the check picks
        assert want > 0.5
        assert got == pytest.approx(want, rel=1e-4)


def test_compiled_checks_read_the_same_rows() -> None:
    assert mismatch_of("eps", "tiny", compiled=True) == \
        pytest.approx(full_mismatch("eps", "tiny"), rel=1e-4)


def test_checked_rows_pick_extremes_and_spread_for_any_token_count() -> None:
    hi = torch.arange(100.0)
    lo = -torch.arange(100.0) / 2
    hi[7], lo[7] = math.nan, math.nan  # non-finite tokens come last
    rows = checked_rows(hi, lo, per_row=1)
    assert rows.shape == (3 * CHECKED,)
    assert set(rows[:CHECKED].tolist()) == set(range(100 - CHECKED, 100))
    assert set(rows[CHECKED:2 * CHECKED].tolist()) == set(range(CHECKED + 1)) - {7}
    assert rows[2 * CHECKED:].tolist() == [i * 100 // CHECKED for i in range(CHECKED)]
    assert (checked_rows(hi, lo, per_row=4) == rows // 4).all()
    short = checked_rows(torch.ones(3), torch.zeros(3), per_row=1)
    assert short.shape == (3 * CHECKED,) and set(short.tolist()) == {0, 1, 2}
