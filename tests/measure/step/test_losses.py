"""Losses stay on their device until the flush's one copy."""

from __future__ import annotations

import warnings

import pytest
import torch

from normwatch.measure.backends import choose
from normwatch.measure.state.accumulator import Accumulator
from normwatch.measure.step.losses import LossBuffer, ride_along


def flushed(buffer: LossBuffer) -> dict[torch.device, list[float]]:
    """What the flush's one copy per device gives back for ``buffer``'s losses (an
    accumulator without layers: the losses alone, joined as float64)."""
    return Accumulator(0, choose).read(ride_along(buffer.tensors()))[1]


def test_tensors_and_numbers_resolve_in_order() -> None:
    buffer = LossBuffer()
    buffer.record(torch.tensor(2.5, requires_grad=True) * 1, step=1)
    buffer.record(3, step=2)
    buffer.record(None, step=3)
    buffer.record(torch.tensor([1.25]), step=4)
    stacked = buffer.tensors()
    assert list(stacked) == [torch.device("cpu")]
    assert stacked[torch.device("cpu")].dtype == torch.float32  # (the flush converts)
    assert not stacked[torch.device("cpu")].requires_grad
    assert buffer.resolve(flushed(buffer)) == ((1, 2.5), (2, 3.0), (4, 1.25))
    buffer.clear()
    assert buffer.resolve({}) == () and buffer.tensors() == {}


@pytest.mark.parametrize("dtypes", [(torch.bfloat16,) * 3,
                                    (torch.bfloat16, torch.int64, torch.float32)])
def test_losses_of_any_dtypes_are_copied_exactly(dtypes: tuple[torch.dtype, ...]) -> None:
    """One dtype or several (an integer past float32's 24 bits among them): each loss
    reaches the host as its own value in float64."""
    values = [1.0078125, 2**40 + 1, 3.25]
    buffer = LossBuffer()
    for step, (value, dtype) in enumerate(zip(values, dtypes, strict=True)):
        buffer.record(torch.tensor(value, dtype=dtype), step=step)
    want = [torch.tensor(v, dtype=d).double().item() for v, d in zip(values, dtypes,
                                                                      strict=True)]
    assert flushed(buffer) == {torch.device("cpu"): want}
    assert (2**40 + 1 in want) == (torch.int64 in dtypes)


def test_a_bad_loss_warns_once_and_is_ignored() -> None:
    buffer = LossBuffer()
    with pytest.warns(RuntimeWarning, match=r"'loss' must be a scalar tensor or a number: got "
                      r"torch.float32 tensor of shape \(2,\) on cpu"):
        buffer.record(torch.ones(2), step=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buffer.record("high", step=2)
    assert caught == []  # warned once per buffer
    assert buffer.resolve({}) == ()


def test_a_meta_loss_is_skipped_with_one_warning_not_a_crash() -> None:
    buffer = LossBuffer()
    with pytest.warns(RuntimeWarning, match=r"got torch.float32 tensor of shape \(\) on meta"):
        buffer.record(torch.empty((), device="meta"), step=1)
    buffer.record(torch.tensor(1.0), step=2)
    stacked = buffer.tensors()
    assert list(stacked) == [torch.device("cpu")]  # nothing to copy from a meta tensor
    assert buffer.resolve({d: t.tolist() for d, t in stacked.items()}) == ((2, 1.0),)
