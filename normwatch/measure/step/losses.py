"""Losses of the interval, kept on their device until the flush.

    >>> buffer = LossBuffer()
    >>> buffer.record(loss, step=3)          # a scalar tensor stays where it is
    >>> values = buffer.resolve(copied)      # at the flush: ((step, float), ...)

A scalar tensor is detached and kept as is (reading it would sync); the flush copies all
of one device's losses in the same device-to-host copy as the statistics. A CUDA loss is
kept as a copy: one a CUDA graph returned (a model compiled with
``mode="reduce-overhead"`` that computes its loss) is overwritten by the graph's next
run, and reading it then raises.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch


class LossBuffer:
    """``(step, loss)`` pairs of one flush interval; see the module docstring."""

    def __init__(self) -> None:
        self._losses: list[tuple[int, torch.Tensor | float]] = []
        self._warned = False

    def record(self, loss: Any, step: int) -> None:
        """Keep ``loss`` (a real scalar tensor with data, or a number) for ``step``;
        anything else (a meta tensor, a vector, a string) warns once and is ignored."""
        if loss is None:
            return
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and not loss.is_meta \
                and not loss.is_complex():
            kept = loss.detach()
            if kept.is_cuda:  # (see the module docstring)
                kept = kept.clone()
            self._losses.append((step, kept.reshape(()) if kept.dim() else kept))
        elif isinstance(loss, numbers.Real):
            self._losses.append((step, float(loss)))
        elif not self._warned:
            self._warned = True
            got = (f"{loss.dtype} tensor of shape {tuple(loss.shape)} on {loss.device}"
                   if isinstance(loss, torch.Tensor) else type(loss).__name__)
            warnings.warn(f"normwatch: 'loss' must be a scalar tensor or a number: got {got}; "
                          "losses are not recorded", RuntimeWarning, stacklevel=4)

    def tensors(self) -> dict[torch.device, torch.Tensor]:
        """The tensor losses stacked per device, to ride along the flush copy (which
        converts them to float64 with the rest): one op, not one a loss."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for _, value in self._losses:
            if isinstance(value, torch.Tensor):
                by_device.setdefault(value.device, []).append(value)
        return {d: torch.stack(v) if len({t.dtype for t in v}) == 1
                else torch.stack([t.to(torch.float64) for t in v])
                for d, v in by_device.items()}

    def resolve(self, copied: Mapping[torch.device, Iterable[float]]
                ) -> tuple[tuple[int, float], ...]:
        """``(step, loss)`` pairs, tensor losses read from ``copied`` (what
        :meth:`tensors` became on the host, per device; iterators are consumed)."""
        iters = {d: iter(v) for d, v in copied.items()}
        return tuple((step, next(iters[value.device]) if isinstance(value, torch.Tensor)
                      else value) for step, value in self._losses)

    def clear(self) -> None:
        self._losses.clear()


def ride_along(*parts: Mapping[torch.device, torch.Tensor | list[torch.Tensor]]
               ) -> dict[torch.device, list[torch.Tensor]]:
    """Several per-device extras as flat tensors per device, in ``parts`` order (read
    them back in that order from iterators over the copy): the flush's one copy per
    device joins them with the state, as float64, in one op (no op here for a vector)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for part in parts:
        for device, value in part.items():
            by_device.setdefault(device, []).extend(
                t if t.dim() == 1 else t.reshape(-1)
                for t in ([value] if isinstance(value, torch.Tensor) else value))
    return by_device
