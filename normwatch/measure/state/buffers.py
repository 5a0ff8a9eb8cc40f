"""Float32 buffers lent to the readers for the rows they stage, taken back at the fold.

    >>> lender = RowBuffers()
    >>> rows = lender.take((4, 128))   # held until the accumulator's next fold
    >>> lender.give_back()             # the rows were folded: every buffer is free again
"""

from __future__ import annotations

import torch


def allocated(shape: tuple[int, ...]) -> torch.Tensor:
    """A new float32 CPU buffer of ``shape``: where rows are read when none is lent."""
    return torch.empty(shape, dtype=torch.float32)


class RowBuffers:
    """Float32 CPU buffers for rows that are staged until a fold: lent by shape, all taken
    back when the rows lent since the last fold are folded (:meth:`give_back`), then lent
    again. An allocation costs ~11 µs inside a training step, a loan ~3. What is kept is
    what the last fold's rows held (and they were alive until it anyway); a shape not
    lent since is let go. A loan is a list's pop (one at a time under the GIL); the
    give-back runs where the fold does, between steps."""

    __slots__ = ("_free", "_lent")

    def __init__(self) -> None:
        self._free: dict[tuple[int, ...], list[torch.Tensor]] = {}
        self._lent: list[torch.Tensor] = []

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A buffer of ``shape``, to hold until the next :meth:`give_back` (the C++ lanes
        lend as this does: :mod:`~normwatch.measure.backends.native.contract`)."""
        free = self._free.get(shape)
        rows = free.pop() if free else allocated(shape)
        self._lent.append(rows)
        return rows

    def give_back(self) -> None:
        """Every buffer lent is free again: the rows in them were folded (or dropped).
        With none lent since the last, nothing changes (a flush folds twice over: its
        second fold must not let the first's buffers go)."""
        if not self._lent:
            return
        free: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for rows in self._lent:
            free.setdefault(tuple(rows.shape), []).append(rows)
        self._free, self._lent = free, []
