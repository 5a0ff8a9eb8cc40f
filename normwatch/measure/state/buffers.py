"""Float32 buffers lent to the readers for the rows they stage, taken back at the fold.

    >>> lender = RowBuffers()
    >>> rows = lender.take((4, 128))           # held until the accumulator's next fold
    >>> rows = lender.take((4, 128), device)   # on a device (the Triton backend's)
    >>> lender.give_back()                     # the rows were folded: every buffer is free again
"""

from __future__ import annotations

import torch


def allocated(shape: tuple[int, ...], device: torch.device | None = None) -> torch.Tensor:
    """A new float32 buffer of ``shape`` (on the CPU, or ``device``): where rows are read
    when none is lent."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def key(shape: tuple[int, ...], device: torch.device | None) -> object:
    """Where free buffers of ``shape`` on ``device`` wait: the CPU's by shape alone, another
    device's by ``(device, shape)`` (the C++ lanes look them up by the same key)."""
    return shape if device is None or device.type == "cpu" else (device, shape)


KEEP_IDLE = 8
"""Give-backs a free buffer is kept without being lent: a full-tier step's buffers wait
``stats_every - 1`` folds where each step folds (the early warning's, on CUDA)."""


class RowBuffers:
    """Float32 buffers for rows that are staged until a fold: lent by shape (and device),
    all taken back when the rows lent since the last fold are folded (:meth:`give_back`),
    then lent again. An allocation costs ~11 µs inside a training step, a loan ~3 (and no
    op dispatched: on a GPU, no allocation per call). What is kept is what the last fold's
    rows held (and they were alive until it anyway), and for :data:`KEEP_IDLE` give-backs
    what was not lent. A loan is a list's pop (one at a time under the GIL); the give-back runs
    where the fold does, between steps. A device buffer is lent again once the fold that
    read it is queued: what writes it next runs after that fold on the stream."""

    __slots__ = ("_free", "_idle", "_lent")

    def __init__(self) -> None:
        self._free: dict[object, list[torch.Tensor]] = {}
        self._lent: list[torch.Tensor] = []
        self._idle: dict[int, int] = {}
        """The free buffers (by id) kept at a give-back without being lent: how many."""

    def take(self, shape: tuple[int, ...], device: torch.device | None = None) -> torch.Tensor:
        """A buffer of ``shape`` (on ``device``; default the CPU), to hold until the next
        :meth:`give_back` (the C++ lanes lend as this does on the CPU:
        :mod:`~normwatch.measure.backends.native.contract`)."""
        free = self._free.get(key(shape, device))
        rows = free.pop() if free else allocated(shape, device)
        self._lent.append(rows)
        return rows

    def give_back(self) -> None:
        """Every buffer lent is free again: the rows in them were folded (or dropped).
        With none lent since the last, nothing changes (a flush folds twice over: its
        second fold must not let the first's buffers go). A free buffer not lent since is
        kept for :data:`KEEP_IDLE` give-backs, then let go: intervals that alternate (two
        full-tier steps in one, three in the next) and steps that each fold (the full
        tier's buffers wait for the next full-tier step) borrow all they need."""
        if not self._lent:
            return
        free: dict[object, list[torch.Tensor]] = {}
        for rows in self._lent:
            free.setdefault(key(tuple(rows.shape), rows.device), []).append(rows)
        idle: dict[int, int] = {}
        for where, left in self._free.items():
            kept = [rows for rows in left if self._idle.get(id(rows), 0) < KEEP_IDLE]
            if kept:
                free.setdefault(where, []).extend(kept)
                idle.update((id(rows), self._idle.get(id(rows), 0) + 1) for rows in kept)
        self._free, self._lent, self._idle = free, [], idle
