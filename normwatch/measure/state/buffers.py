"""Float32 buffers lent to the readers for the rows they stage, taken back at the fold.

    >>> lender = RowBuffers()
    >>> rows = lender.take((4, 128))           # held until the accumulator's next fold
    >>> rows = lender.take((4, 128), device)   # on a device (the Triton backend's)
    >>> lender.give_back()                     # the rows were folded: every buffer is free again

A buffer outlives the call that took it, so it must not come from a CUDA graph's memory
pool: CUDA graph trees (``mode="reduce-overhead"``) send every allocation of the thread
that warms up or records a graph into the graph's pool, and a tensor left alive there
that the graph does not return fails their check ("tensors in the cudagraph pool not
tracked as outputs"). They do that on a stream of their own, so a buffer asked for on a
stream other than its device's default one is made by a thread of normwatch's own, on
that stream (:func:`allocated`); on the default stream (every eager step), as torch makes
any tensor.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from itertools import groupby

import torch


def allocated(shape: tuple[int, ...], device: torch.device | None = None) -> torch.Tensor:
    """A new float32 buffer of ``shape`` (on the CPU, or ``device``): where rows are read
    when none is lent; on CUDA, never in a CUDA graph's pool (see the module docstring)."""
    if device is not None and device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        if stream != torch.cuda.default_stream(device):
            return _maker().submit(_made_on, shape, stream).result()
    return torch.empty(shape, dtype=torch.float32, device=device)


@functools.cache
def _maker() -> ThreadPoolExecutor:
    """The thread that makes buffers off the caller's thread (and so off any pool the
    caller's thread allocates to)."""
    return ThreadPoolExecutor(1, thread_name_prefix="normwatch-buffers")


def _made_on(shape: tuple[int, ...], stream: torch.cuda.Stream) -> torch.Tensor:
    with torch.cuda.stream(stream):  # (its device too) as the caller would have made it
        return torch.empty(shape, dtype=torch.float32, device=stream.device)


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
    op dispatched: on a GPU, no allocation per call). What is kept of a shape is as many
    as were lent at once in the last :data:`KEEP_IDLE` + 1 give-backs. A loan is a list's
    pop (one at a time under the GIL); the give-back runs where the fold does, between
    steps, with no Python per buffer (a step's calls' are many, its shapes few). A device
    buffer is lent again once the fold that read it is queued: what writes it next runs
    after that fold on the stream."""

    __slots__ = ("_free", "_lent", "_of", "_shapes")

    def __init__(self) -> None:
        self._free: dict[object, list[torch.Tensor]] = {}
        self._lent: list[torch.Tensor] = []
        self._shapes: dict[object, _Shape] = {}
        """Per key, the shape's loans (:class:`_Shape`)."""
        self._of: dict[int, _Shape] = {}
        """Each buffer's (by id) shape."""

    def take(self, shape: tuple[int, ...], device: torch.device | None = None) -> torch.Tensor:
        """A buffer of ``shape`` (on ``device``; default the CPU), to hold until the next
        :meth:`give_back` (the C++ lanes lend as this does on the CPU:
        :mod:`~normwatch.measure.backends.native.contract`)."""
        where = key(shape, device)
        free = self._free.get(where)
        if free:
            rows = free.pop()
        else:
            rows = allocated(shape, device)
            self._of[id(rows)] = self._shapes.setdefault(where, _Shape())
        self._lent.append(rows)
        return rows

    def give_back(self) -> None:
        """Every buffer lent is free again: the rows in them were folded (or dropped).
        With none lent since the last, nothing changes (a flush folds twice over: its
        second fold must not let the first's buffers go). Of each shape as many are kept
        as were lent at once in the last :data:`KEEP_IDLE` + 1 give-backs, the rest let
        go: intervals that alternate (two full-tier steps in one, three in the next) and
        steps that each fold (the full tier's buffers wait for the next full-tier step)
        borrow all they need."""
        lent = self._lent
        if not lent:
            return
        self._lent = []
        # grouped by shape with C's iterators: no Python a buffer (a step's calls are
        # many, its shapes few)
        of = list(map(self._of.__getitem__, map(id, lent)))
        ids = list(map(id, of))
        back: dict[_Shape, list[torch.Tensor]] = {}
        for _, group in groupby(sorted(range(len(lent)), key=ids.__getitem__), ids.__getitem__):
            at = list(group)
            back[of[at[0]]] = list(map(lent.__getitem__, at))
        for where, loans in [*self._shapes.items()]:
            now = back.get(loans, [])
            loans.lent.append(len(now))
            del loans.lent[:-KEEP_IDLE - 1]
            pool = now + self._free.get(where, [])  # (the idle last: let go first)
            kept = max(loans.lent)
            for rows in pool[kept:]:  # let go
                del self._of[id(rows)]
            if kept:
                self._free[where] = pool[:kept]
            else:  # (a shape no longer met: a token count of the past)
                self._free.pop(where, None)
                del self._shapes[where]


class _Shape:
    """One shape's (and device's) loans: how many were lent at each of the last
    :data:`KEEP_IDLE` + 1 give-backs."""

    __slots__ = ("lent",)

    def __init__(self) -> None:
        self.lent: list[int] = []
