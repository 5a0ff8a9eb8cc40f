"""Early warnings: one copy in flight, read only after its event completed."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from normwatch.catalog import COLUMNS, identity_row
from normwatch.measure.step.early import EarlyWarning


class FakeEvent:
    """A CUDA event stand-in whose completion the test decides."""

    made: ClassVar[list[FakeEvent]] = []

    def __init__(self) -> None:
        self.done = False
        self.recorded = False
        FakeEvent.made.append(self)

    def record(self) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.done


def block(**cells: float) -> torch.Tensor:
    rows = torch.tensor([identity_row(COLUMNS) for _ in range(3)], dtype=torch.float64)
    for key, value in cells.items():
        layer, column = key.rsplit("_", 1)[0], key.rsplit("_", 1)[1]
        rows[int(column), COLUMNS.index(layer)] = value
    return rows


def test_trouble_is_seen_once_the_copy_landed_and_never_before() -> None:
    FakeEvent.made.clear()
    early = EarlyWarning(256.0, event_factory=FakeEvent, pin=False)
    device = torch.device("cpu")
    live = block(absmax_0=3.0, absmax_1=300.0, nonfinite_2=1.0)
    early.launch({device: live})
    assert FakeEvent.made[0].recorded
    assert early.poll() is None  # not landed: nothing read, no waiting
    early.launch({device: live})  # still in flight: no second copy
    assert len(FakeEvent.made) == 1
    FakeEvent.made[0].done = True
    assert early.poll() == [1, 2]  # layer 1 past the limit, layer 2 saw NaN/inf
    assert early.poll() is None


def test_the_copy_is_a_snapshot_and_reset_forgets_it() -> None:
    FakeEvent.made.clear()
    early = EarlyWarning(256.0, event_factory=FakeEvent, pin=False)
    device = torch.device("cpu")
    live = block(absmax_0=1.0)
    early.launch({device: live})
    live[0, COLUMNS.index("out_nonfinite")] = 5.0  # changes after the copy do not leak in
    FakeEvent.made[0].done = True
    assert early.poll() == []
    early.launch({device: live})
    early.reset()
    FakeEvent.made[-1].done = True
    assert early.poll() is None
    healthy = block(absmax_0=-math.inf)
    early.launch({device: healthy})
    FakeEvent.made[-1].done = True
    assert early.poll() == []
