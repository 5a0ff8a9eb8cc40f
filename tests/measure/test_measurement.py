"""The measurement object: steps, raw rows, snapshots, reset, probes, pausing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from normwatch.catalog import RAW
from normwatch.measure.measurement import Measurement
from normwatch.measure.model.discovery import iter_norm_modules
from normwatch.records import Limits


def setup() -> tuple[nn.Module, Measurement]:
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.RMSNorm(8))
    return model, Measurement(iter_norm_modules(model), Limits())


def test_raw_rows_hold_every_column_and_the_snapshot_matches_float64() -> None:
    model, m = setup()
    x = torch.randn(5, 8) * 3
    model(x).sum().backward()
    rows, _ = m.read()
    assert [set(r) for r in rows] == [set(RAW)] * 2
    assert (rows[0]["calls"], rows[0]["tokens"]) == (1.0, 5.0)
    snap = m.snapshot(rows, step=1, first_step=1)
    h = model[0](x).detach().double()
    rms = h.pow(2).mean(1).sqrt()
    s = snap.layers["1"]
    assert s.absmax == pytest.approx(float(h.abs().max()), rel=1e-6)
    assert s.rms_mean == pytest.approx(float(rms.mean()), rel=1e-6)
    assert (s.rms_min, s.rms_max) == (pytest.approx(float(rms.min()), rel=1e-6),
                                      pytest.approx(float(rms.max()), rel=1e-6))
    assert m.forward_order == ["1", "3"]
    m.close()


def test_begin_step_switches_tiers_and_reset_starts_a_new_interval() -> None:
    model, m = setup()
    m.begin_step(2, full=False)  # sentinel tier: max |x| only
    model(torch.randn(4, 8)).sum().backward()
    rows, _ = m.read()
    snap = m.snapshot(rows, 2, 2)
    assert snap.layers["1"].absmax is not None and snap.layers["1"].rms_mean is None
    assert snap.layers["1"].stats_tokens == 0
    m.reset(check_outputs=False)
    rows, _ = m.read()
    assert rows[0]["tokens"] == 0 and m.snapshot(rows, 3, 3).layers["1"].absmax is None
    m.close()


def test_extras_ride_along_the_flush_copy() -> None:
    model, m = setup()
    model(torch.randn(2, 8)).sum().backward()
    _, copied = m.read({torch.device("cpu"): torch.tensor([1.5, 2.5])})
    assert copied == {torch.device("cpu"): [1.5, 2.5]}
    m.close()


def test_paused_hooks_stand_aside_and_probes_are_cached(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    import normwatch.measure.model.probe as probe

    model = nn.Sequential(nn.Linear(8, 8), nn.RMSNorm(8)).half()
    m = Measurement(iter_norm_modules(model), Limits())
    calls = []
    real = probe.probe_fp16_safety

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args[0].name)
        return real(*args, **kwargs)

    monkeypatch.setattr(probe, "probe_fp16_safety", counted)
    for step in range(2):
        m.begin_step(step + 1, full=True)
        model(torch.randn(4, 8, dtype=torch.half) * 400).float().sum().backward()
        rows, _ = m.read()
        snap = m.snapshot(rows, step + 1, step + 1)
        results = m.probes(snap)
        assert results["1"].element_safe is True  # torch's RMSNorm upcasts
        assert snap.layers["1"].calls == 1  # the probe's own forward was not counted
        m.reset(check_outputs=False)
    assert calls == ["1"]  # probed once
    with m.paused():
        model(torch.randn(1, 8, dtype=torch.half)).float().sum().backward()
    rows, _ = m.read()
    assert rows[0]["calls"] == 0
    m.close()


def test_an_interrupted_forward_is_dropped_at_the_next_step() -> None:
    class Flaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.LayerNorm(8), nn.LayerNorm(8)
            self.fail = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.first(x)
            if self.fail:
                raise RuntimeError("out of memory")  # after the first norm ran
            return self.second(h)

    model = Flaky()
    m = Measurement(iter_norm_modules(model), Limits(), root=model)
    model(torch.randn(2, 8, requires_grad=True))
    model.fail = True
    with pytest.raises(RuntimeError, match="out of memory"):
        model(torch.randn(3, 8, requires_grad=True) * 1000)  # the loop skips this batch
    assert m.pending  # a crash report would read it; the loop went on, so it is dropped
    m.begin_step(2, full=True)
    model.fail = False
    model(torch.randn(4, 8, requires_grad=True))
    rows, _ = m.read()
    snap = m.snapshot(rows, 2, 1)
    assert (snap.layers["first"].calls, snap.layers["first"].tokens) == (2, 6)
    assert (snap.layers["second"].calls, snap.layers["second"].tokens) == (2, 6)
    assert snap.layers["first"].absmax is not None and snap.layers["first"].absmax < 100
    m.close()
    assert not model._forward_pre_hooks and not model._forward_hooks
