"""Alarms without stalls on CUDA: peek at the sentinel columns one step late.

At every step the small accumulator columns that matter most (max |x| and the non-finite
counts, a few floats per layer) are copied into pinned host memory with
``non_blocking=True`` and a CUDA event is recorded behind the copy. At a later step the
event is asked, with ``event.query()`` (never ``synchronize()``), whether the copy landed;
if so the host reads plain memory. A NaN or an fp16 overflow is thus seen one or two steps
after it happened, with zero stalls; the watch then flushes at once (``flush()`` stays the
explicit sync). Only one copy is in flight at a time.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from itertools import compress, count, repeat
from operator import itemgetter
from typing import Protocol

import torch

from normwatch.catalog import COLUMNS, STATS

PEEKED = ("absmax", "nonfinite", "out_nonfinite")
assert all(STATS[c].tier == "sentinel" for c in PEEKED)  # measured at every call
PEEK_COLUMNS = tuple(COLUMNS.index(c) for c in PEEKED)


class Event(Protocol):
    def record(self) -> None: ...
    def query(self) -> bool: ...


class EarlyWarning:
    """One in-flight device-to-pinned-host copy per device block; see the module docstring."""

    def __init__(self, fp16_limit: float,
                 event_factory: Callable[[], Event] | None = None,
                 pin: bool = True) -> None:
        self.fp16_limit = fp16_limit
        self._event_factory = event_factory or _cuda_event
        self._pin = pin
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._pending: dict[torch.device, Event] = {}

    def launch(self, blocks: dict[torch.device, torch.Tensor]) -> None:
        """Start a copy of each block's peek columns unless one is still in flight."""
        for device, block in blocks.items():
            if device in self._pending:
                continue
            buf = self._buffers.get(device)
            if buf is None:  # the whole block is a few floats per layer: copy it as is
                buf = torch.empty(block.shape, dtype=block.dtype,
                                  pin_memory=self._pin and torch.cuda.is_available())
                self._buffers[device] = buf
            buf.copy_(block, non_blocking=True)
            event = self._event_factory()
            event.record()
            self._pending[device] = event

    def poll(self) -> list[int] | None:
        """Rows (layer indices) whose landed copy shows trouble; ``None`` if nothing landed.

        Reads host memory only after its event completed: no device synchronisation.
        """
        landed: list[int] | None = None
        a, n_in, n_out = PEEK_COLUMNS
        for device, event in list(self._pending.items()):
            if not event.query():
                continue
            del self._pending[device]
            rows = self._buffers[device].tolist()
            bad = {*_over(rows, n_in, 0.0), *_over(rows, n_out, 0.0),
                   *_over(rows, a, self.fp16_limit)}
            landed = (landed or []) + sorted(bad)
        return landed

    def reset(self) -> None:
        """Forget in-flight copies (after a flush the accumulators restart)."""
        self._pending.clear()


def _over(rows: list[list[float]], column: int, limit: float) -> Iterator[int]:
    """The indices of ``rows`` whose ``column`` is above ``limit`` (C's iterators: no
    Python a row, each step)."""
    return compress(count(), map(operator.gt, map(itemgetter(column), rows), repeat(limit)))


def _cuda_event() -> Event:
    event: Event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    return event
