"""The FSDP2 lookup outside a process group: nothing sharded, and FSDP2 internals that
break (the real sharded runs are in ``test_fsdp.py``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import normwatch
from normwatch.measure.model.sharding import local, unsharded_params


class Broken(nn.Module):
    """A module claiming FSDP2 state that fails to give it (private API changed)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.lin = nn.Linear(8, 8)

    def _get_fsdp_state(self) -> object:
        raise RuntimeError("no FSDP state here")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.norm(x))


def test_nothing_sharded_is_none_and_local_is_the_tensor() -> None:
    model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4))
    assert unsharded_params(model) is None
    t = torch.ones(3)
    assert local(t) is t


def test_an_unsharded_model_is_looked_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import normwatch.measure.measurement as measurement

    looks: list[nn.Module] = []

    def counted(root: nn.Module) -> object:
        looks.append(root)
        return unsharded_params(root)

    monkeypatch.setattr(measurement, "unsharded_params", counted)
    model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4))
    w = normwatch.watch(model, flush_every=2, report_dir=None)
    for _ in range(6):  # three flush intervals
        model(torch.randn(3, 4)).sum().backward()
        w.step()
    w.close()
    assert looks == [model]


def test_a_failing_lookup_warns_once_and_training_goes_on() -> None:
    torch.manual_seed(0)
    model = Broken()
    w = normwatch.watch(model, stats_every=1, report_dir=None)
    norms = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            w.flush()  # each interval looks again, unless the lookup failed
            model(torch.randn(2, 5, 8)).square().mean().backward()
            norms.append(model.norm.weight.grad.double().norm().item())
            model.zero_grad()
            w.step()
    snap = w.flush()
    w.close()
    found = [c for c in caught if "unsharded weights failed" in str(c.message)]
    assert len(found) == 1 and "no FSDP state here" in str(found[0].message)
    stats = snap.layers["norm"]
    assert stats.calls == 1  # measured all along, the weight gradient too
    rms = norms[-1]
    assert stats.weight_grad_norm == pytest.approx(rms, rel=1e-5)
