"""The native readers: a norm call, a gradient and the gradient through a norm read
in one pass each by the C library (:mod:`~normwatch.measure.backends.native.build`).

    >>> rows = row_stats(tokens, out)   # (4, tokens) float32, or None: use torch's
    >>> rows = row_stats(tokens, out, "centred")   # (7, tokens): then sum, L2, spread

Torch's row reductions read an activation once per statistic (``amax`` and ``amin`` of
the input and of the output, then a ``stack``: five ops, four passes); this reads each
tensor once, vectorised, into one float32 buffer (exact: a max or a min is one of the
values), with NaN where a row holds one, as ``amax``/``amin`` give. Past torch's grain
size a pass splits the rows over torch's own threads where the library shares them
(:data:`GRAIN`). For what it does not cover (other dtypes, rows that are not
contiguous) the caller uses torch's reductions. Each reader keeps the plan of the last
layout it met (:class:`Planned`): the checks of a general call cost several times the
call's own Python inside a training step. Rows are read into buffers lent until the
fold (:class:`RowBuffers`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Hashable
from typing import Generic, NamedTuple, TypeVar

import torch

from normwatch.measure.backends.native.build import library, threaded
from normwatch.measure.state.buffers import allocated

MAX_ELEMENTS = 1 << 21
"""Without torch's threads (see :func:`threaded`): the most elements per tensor read here
(4 MiB of bf16) on one thread; beyond, torch's reductions split the rows over its
threads."""
GRAIN = 32768
"""Torch's grain size: below it its reductions run on one thread, and so does this kernel.
Past it the kernel splits the rows over torch's threads, when it shares them
(:func:`threaded`). Without them, float32 past the grain is left to torch's reductions
where torch has several threads: an activation a multi-threaded op just wrote lies in
several cores' caches, and their passes, each core reading its part, beat one pass on
one core there (measured: 146-194 µs against 181-196 µs for 512 x 256 after the caches
were flushed; bf16 and fp16, whose torch reductions convert every element, 292 against
171 µs), and a single-thread pass lets torch's idle threads fall asleep."""
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
"""Whether a tensor is one of vmap's or grad's wrappers (no data pointer)."""


def _rowwise(t: torch.Tensor) -> tuple[int, int] | None:
    """``(width, row stride)`` of ``t`` read as rows of its last dim, or ``None`` when
    the kernel does not cover it."""
    if type(t) is not torch.Tensor or t.device.type != "cpu" or t.dtype not in KINDS \
            or t.layout != torch.strided or t.dim() == 0 or not t.numel() \
            or _wrapped(t):
        return None  # (vmap's and grad's wrappers have no data pointer)
    if t.is_contiguous():
        return t.shape[-1], t.shape[-1]
    if t.dim() == 2 and t.stride(1) == 1:
        return t.shape[1], t.stride(0)
    return None


def _threads(x: torch.Tensor, out: torch.Tensor | None) -> int:
    """The threads to read ``x`` and ``out`` on (torch's, past :data:`GRAIN`), or 0:
    leave them to torch's reductions (see :data:`GRAIN`, :data:`MAX_ELEMENTS`)."""
    big = max(x.numel(), 0 if out is None else out.numel())
    threads = torch.get_num_threads()
    if big <= GRAIN or threads == 1:
        return 1
    if threaded():
        return threads
    if big > MAX_ELEMENTS or torch.float32 in (x.dtype, None if out is None else out.dtype):
        return 0
    return 1


INTEGERS = {torch.int64: 0, torch.int32: 1}
"""The integer dtypes :func:`batch_hash` reads."""


def batch_hash(t: torch.Tensor) -> int | None:
    """The replay log's hash of ``t`` (:func:`~normwatch.measure.step.replay.hashed`: a CPU
    integer tensor's, in one call, on the host), or ``None`` where the kernel does not
    read it (another device, dtype or layout, no library)."""
    kind = INTEGERS.get(t.dtype)
    if kind is None or type(t) is not torch.Tensor or not t.is_cpu \
            or t.layout != torch.strided or not t.is_contiguous() or _wrapped(t):
        return None
    lib = library()
    return None if lib is None else lib.normwatch_hash(t.data_ptr(), kind, t.numel())


MOMENTS = {"rms": 1, "centred": 2}
"""What :func:`row_stats` adds after the extremes: each row's sum, L2 norm and spread
(``"centred"``: the L2 norm about the row's mean; ``"rms"``: the L2 norm again)."""


def moments_of(centred: bool) -> str:
    """The full tier's moments (:data:`MOMENTS`) of a norm that centres, or not."""
    return "centred" if centred else "rms"


class RowPlan(NamedTuple):
    """What the kernel needs of a call's layout (:func:`row_plan`)."""

    shape: tuple[int, ...]
    """The rows' shape, ``(k, *x.shape[:-1])``."""
    args: ctypes.Array[ctypes.c_int64]
    """``normwatch_rows_planned``'s plan: x's kind, width and row stride, then out's, the
    row count, the threads and the moments."""


def row_plan(x: torch.Tensor, out: torch.Tensor | None,
             moments: str | None = None) -> RowPlan | None:
    """The :class:`RowPlan` of reading ``x`` and ``out`` (see :func:`row_stats`), or
    ``None`` where torch's reductions must do it."""
    shape_x = _rowwise(x)
    shape_out = (0, 0) if out is None else _rowwise(out)
    if shape_x is None or shape_out is None:
        return None
    lib = library()  # only once a tensor it covers comes: no compiler run for CUDA ones
    threads = 0 if lib is None else _threads(x, out)
    if lib is None or not threads:
        return None
    k = (2 if out is None else 4) + (3 if moments else 0)
    args = (KINDS[x.dtype], *shape_x, 0 if out is None else KINDS[out.dtype], *shape_out,
            x.shape[:-1].numel(), threads, MOMENTS[moments] if moments else 0)
    return RowPlan((k, *x.shape[:-1]), (ctypes.c_int64 * len(args))(*args))


def read_rows(plan: RowPlan, x: torch.Tensor, out: torch.Tensor | None,
              rows: torch.Tensor | None = None) -> torch.Tensor:
    """``x``'s and ``out``'s rows as ``plan`` (theirs) says, into ``rows`` (float32,
    contiguous, of ``plan.shape``; ``None``: allocated): one call."""
    if rows is None:
        rows = allocated(plan.shape)
    library().normwatch_rows_planned(  # type: ignore[union-attr]
        x.data_ptr(), None if out is None else out.data_ptr(), rows.data_ptr(), plan.args)
    return rows


def row_stats(x: torch.Tensor, out: torch.Tensor | None,
              moments: str | None = None) -> torch.Tensor | None:
    """``(k, *x.shape[:-1])`` float32: each row's max and min of ``x``, then of ``out``
    (whose leading dims are ``x``'s), then with ``moments`` (see :data:`MOMENTS`) ``x``'s
    sum, L2 norm and spread, summed in float64; or ``None`` where torch's reductions must
    do it (see the module docstring)."""
    plan = row_plan(x, out, moments)
    return None if plan is None else read_rows(plan, x, out)


K = TypeVar("K", bound=Hashable)
P = TypeVar("P")


class Planned(Generic[K, P]):
    """The plan of the last layout met, kept as one pair (swapped whole: a call on
    another thread never reads another layout's plan): ``get(key, make)`` makes one only
    for a new layout."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: tuple[K, P] | None = None

    def get(self, key: K, make: Callable[[], P]) -> P:
        last = self._last
        if last is None or last[0] != key:
            last = self._last = (key, make())
        return last[1]


PLAIN = (torch.Tensor, torch.nn.Parameter)
"""The tensor types the C readers read as they are (no subclass: a DTensor is torch's)."""


def readable(t: object, types: tuple[type, ...] = (torch.Tensor,)) -> bool:
    """Whether the C readers take ``t`` as it is: a contiguous strided CPU tensor of one
    of ``types`` (an activation: a plain tensor; a weight: :data:`PLAIN`), with no vmap
    or grad wrapper (no data pointer)."""
    return type(t) in types and isinstance(t, torch.Tensor) and t.is_cpu \
        and t.layout == torch.strided and t.is_contiguous() and not _wrapped(t)


Plan = ctypes.Array[ctypes.c_int64]
"""A C reader's plan of a layout (its arguments, as the C source reads them)."""


class RowReader:
    """:func:`row_stats` for one layer's calls whose input and output are alike (the
    same shape, contiguous, on the CPU): their layout worked out once per tier
    (:func:`row_plan`), then each call one call of the kernel, into a buffer of
    ``take``'s (a lender's, or :func:`allocated`)."""

    __slots__ = ("_planned", "_take")

    def __init__(self, take: Callable[[tuple[int, ...]], torch.Tensor] = allocated) -> None:
        self._take = take
        self._planned: dict[str | None, Planned[tuple[object, ...], RowPlan | None]] = {}
        """Per moments (each tier's: a layer's calls switch tiers every few steps)."""

    def __call__(self, x: torch.Tensor, out: torch.Tensor,
                 moments: str | None = None) -> torch.Tensor | None:
        """The rows of ``x`` and ``out`` (:func:`row_stats`), or ``None``: not alike, or
        left to torch's reductions."""
        if not (readable(x) and readable(out)) or out.shape != x.shape:
            return None
        planned = self._planned.get(moments) or self._planned.setdefault(moments, Planned())
        plan = planned.get((x.shape, x.dtype, out.dtype, torch.get_num_threads()),
                           lambda: row_plan(x, out, moments))
        return None if plan is None else read_rows(plan, x, out, self._take(plan.shape))


def grad_rows(a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor | None:
    """A gradient read in one pass: ``(n + 2,)`` float32, each of its ``n`` rows' L2 norm
    (summed in float32, as torch's ``vector_norm``) then its min and max (NaN both where
    it holds a NaN); ``b``: a second part of the gradient, laid out as ``a`` (added in
    float32). ``None`` where torch's reductions must do it (:func:`row_stats`' cases, and
    rows that are not contiguous)."""
    plan = grad_read_plan(a, b)
    return None if plan is None else read_grad(plan, a, b)


def grad_read_plan(a: torch.Tensor, b: torch.Tensor | None = None,
                   whole: bool = False) -> Plan | None:
    """``normwatch_grad_rows_planned``'s plan of reading ``a`` (and ``b``) as
    :func:`grad_rows` does (``whole``: as one row), or ``None`` where it does not."""
    shape = _rowwise(a)
    if shape is None or shape[0] != shape[1] or (b is not None and (
            b.shape != a.shape or b.dtype != a.dtype or _rowwise(b) != shape)) or \
            (whole and not a.is_contiguous()):
        return None
    lib = library()
    threads = 0 if lib is None else _threads(a, b)
    if lib is None or not threads:
        return None
    width = a.numel() if whole else a.shape[-1]
    args = (KINDS[a.dtype], a.numel() // width, width, threads)
    return (ctypes.c_int64 * len(args))(*args)


def read_grad(plan: Plan, a: torch.Tensor, b: torch.Tensor | None,
              rows: torch.Tensor | None = None) -> torch.Tensor:
    """``a``'s (and ``b``'s) rows as ``plan`` (theirs) says, into ``rows`` (float32, of
    the rows' count plus 2; ``None``: allocated): one call."""
    if rows is None:
        rows = allocated((plan[1] + 2,))
    library().normwatch_grad_rows_planned(  # type: ignore[union-attr]
        a.data_ptr(), None if b is None else b.data_ptr(), rows.data_ptr(), plan)
    return rows


class GradReader:
    """:func:`grad_rows` for one site's gradients (``whole``: each read as one row, a
    weight's), mostly laid out alike from one step to the next: the plan of the last
    layout kept, the rows put in a buffer of ``take``'s (a lender's, or
    :func:`allocated`)."""

    __slots__ = ("_planned", "_take", "_whole")

    def __init__(self, whole: bool = False,
                 take: Callable[[tuple[int, ...]], torch.Tensor] = allocated) -> None:
        self._whole = whole
        self._take = take
        self._planned: Planned[tuple[object, ...], Plan | None] = Planned()

    def __call__(self, a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor | None:
        """The rows of ``a`` (and ``b``) (:func:`grad_rows`), or ``None``: left to torch's
        reductions."""
        if not readable(a) or (b is not None and not readable(b)):
            return None if self._whole else grad_rows(a, b)
        key = (a.shape, a.dtype, None if b is None else (b.shape, b.dtype),
               torch.get_num_threads())
        plan = self._planned.get(key, lambda: grad_read_plan(a, b, self._whole))
        return None if plan is None else read_grad(plan, a, b, self._take((plan[1] + 2,)))


class ThroughReader:
    """A norm's output gradient and the gradient through the norm, in one call of the
    kernel (``normwatch_through``): ``g``'s rows as :func:`grad_rows` gives them (the
    same min and max, each norm to float32 rounding: summed in another order), and
    the rows of ``dL/dx`` through a layer or RMS norm, computed row by row from ``g``, the
    norm's input and its weight (never stored), for float32 tensors laid out alike,
    contiguous, on the CPU (the input and weight checked in the forward,
    :meth:`covers`; the gradient as it comes); the last layout's plan kept, the rows put
    in buffers of ``take``'s (see :class:`GradReader`)."""

    __slots__ = ("_centred", "_eps", "_planned", "_plus", "_take")

    def __init__(self, centred: bool, eps: float, one_plus_w: bool,
                 take: Callable[[tuple[int, ...]], torch.Tensor] = allocated) -> None:
        self._centred, self._eps, self._plus = int(centred), eps, int(one_plus_w)
        self._take = take
        self._planned: Planned[tuple[object, ...], Plan | None] = Planned()

    @staticmethod
    def covers(x: torch.Tensor, weight: object) -> bool:
        """Whether a norm's input ``x`` and ``weight`` (``None``: none) are read here: a
        plain float32 tensor, contiguous, on the CPU; a weight the same, one per element
        of ``x``'s last dim; and the library is built."""
        f32 = torch.float32
        return readable(x) and x.dtype == f32 and (weight is None or (
            isinstance(weight, torch.Tensor) and readable(weight, PLAIN)
            and weight.dtype == f32 and weight.numel() == x.shape[-1])) \
            and library() is not None

    def __call__(self, g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(g's rows, dL/dx's rows)``, or ``None``: left to torch (``x`` and ``weight``
        as :meth:`covers` takes them)."""
        if not readable(g) or g.dtype != torch.float32 or g.shape != x.shape \
                or (weight is not None and not weight.untyped_storage().nbytes()):
            return None  # (a weight whose storage was let go: FSDP2's, resharded)
        plan = self._planned.get((g.shape, torch.get_num_threads()), lambda: self.plan(g))
        if plan is None:
            return None
        rows = plan[0] + 2
        dg, din = self._take((rows,)), self._take((rows,))
        library().normwatch_through(  # type: ignore[union-attr]
            g.data_ptr(), x.data_ptr(), None if weight is None else weight.data_ptr(),
            dg.data_ptr(), din.data_ptr(), plan, self._eps)
        return dg, din

    def plan(self, g: torch.Tensor) -> Plan | None:
        """``normwatch_through``'s plan for gradients laid out as ``g`` (``None``: left
        to torch)."""
        lib = library()
        threads = 0 if lib is None or not g.dim() else _threads(g, None)
        if lib is None or not threads or not g.numel():
            return None
        width = g.shape[-1]
        args = (g.numel() // width, width, self._centred, self._plus, threads)
        return (ctypes.c_int64 * len(args))(*args)
