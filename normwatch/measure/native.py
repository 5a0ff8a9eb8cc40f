"""Native CPU kernels: a norm call in one call (each token's max and min of its input
and output, and on full-tier steps the input's moments, here), a gradient in one pass
(:class:`GradReader`) and the gradient through a norm computed with its output's
(:class:`ThroughReader`), the folds, and the update monitor's sample
(:mod:`~normwatch.measure.native_updates`), from one C library built at first use.

    >>> rows = row_stats(tokens, out)   # (4, tokens) float32, or None: use torch's
    >>> rows = row_stats(tokens, out, "centred")   # (7, tokens): then sum, L2, spread

Torch's row reductions read an activation once per statistic (``amax`` and ``amin`` of
the input and of the output, then a ``stack``: five ops, four passes); this reads each
tensor once, vectorised, into one float32 buffer (exact: a max or a min is one of the
values), with NaN where a row holds one, as ``amax``/``amin`` give. The C source
(``native_rows.c``, shipped with the package) is compiled at first use with the
system's C compiler into a per-user cache (``$NORMWATCH_CACHE``, else
``$XDG_CACHE_HOME/normwatch`` or ``~/.cache/normwatch``), named by a hash of the source,
the compiler and torch's OpenMP runtime. Built with OpenMP and linked to that runtime
(:func:`openmp_runtime`), a pass past torch's grain size splits the rows over torch's
own threads, as torch's reductions do; elsewhere it runs on one thread (see
:data:`GRAIN`). Without a compiler, or for what it does not cover (other dtypes, rows
that are not contiguous), the caller uses torch's reductions. Set
``NORMWATCH_NATIVE=0`` (or ``kernel="torch"``) to never use it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

SOURCE = Path(__file__).with_name("native_rows.c")
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

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where the compiled library is kept (made private to this user)."""
    root = os.environ.get("NORMWATCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "normwatch")
    return Path(root)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel (compiled now if not cached), or ``None`` where it cannot be
    (no compiler, a failed build, ``NORMWATCH_NATIVE=0``): then torch's reductions."""
    if os.environ.get("NORMWATCH_NATIVE", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(_built()))
        fn = lib.normwatch_rows
    except Exception as exc:  # no compiler, a failed build or load: torch's reductions
        log.debug("normwatch: native row kernel unavailable (%s); using torch", exc)
        return None
    i64 = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, i64, i64, ctypes.c_void_p, ctypes.c_int,
                   i64, i64, i64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    rows = lib.normwatch_grad_rows  # grad_rows
    rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, i64, i64, ctypes.c_void_p,
                     ctypes.c_int]
    rows.restype = ctypes.c_int
    lines = lib.normwatch_accumulate  # accumulate
    lines.argtypes = [i64, ctypes.c_void_p, i64, ctypes.c_void_p, i64, i64, ctypes.c_void_p]
    lines.restype = ctypes.c_int
    through = lib.normwatch_through  # ThroughReader
    through.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_double]
    through.restype = ctypes.c_int
    for planned in (lib.normwatch_rows_planned, lib.normwatch_grad_rows_planned):
        planned.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        planned.restype = ctypes.c_int  # read_rows, GradReader
    i64s, ptrs = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_void_p)
    sample = lib.normwatch_sample  # normwatch.measure.native_updates
    sample.argtypes = [ctypes.c_int64, ctypes.c_int, i64s, i64s, i64s,
                       ctypes.POINTER(ctypes.c_double), ptrs, ptrs, ctypes.c_void_p,
                       ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    sample.restype = ctypes.c_int
    lib.normwatch_threaded.restype = ctypes.c_int
    lib.normwatch_hash.argtypes = [ctypes.c_void_p, ctypes.c_int, i64]  # batch_hash
    lib.normwatch_hash.restype = i64
    fold = lib.normwatch_fold  # fold_rows
    fold.argtypes = [i64, ptrs, ctypes.c_void_p, ctypes.c_int, ctypes.c_float,
                     ctypes.c_float, ctypes.c_double, i64s, i64, ctypes.c_void_p]
    fold.restype = ctypes.c_int
    grads = lib.normwatch_fold_grads  # fold_grad_rows
    grads.argtypes = [i64, ptrs, ctypes.c_void_p, i64, ptrs, ctypes.c_void_p, ctypes.c_void_p]
    grads.restype = ctypes.c_int
    return lib


def threaded() -> bool:
    """Whether the kernel splits rows over torch's own threads: built with OpenMP and
    linked to the runtime torch's threads run on (:func:`openmp_runtime`)."""
    lib = library()
    return lib is not None and _built_threaded(lib)


@functools.cache
def _built_threaded(lib: ctypes.CDLL) -> bool:
    return bool(lib.normwatch_threaded())  # (asked once per library: a ctypes call)


def openmp_runtime() -> str | None:
    """The file of GNU OpenMP (libgomp) torch's threads run on, loaded in this process:
    linked to it, the kernel's parallel regions use torch's thread pool (another
    runtime would start threads of its own, competing with torch's). ``None``: another
    backend or runtime, or not Linux; the kernel is then built single-threaded."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    return torchs_libgomp(maps, Path(torch.__file__).parent)


def torchs_libgomp(maps: str, package: Path) -> str | None:
    """The libgomp among the files mapped in ``maps`` (``/proc/self/maps``' text) that
    torch's package (``package``: its folder) ships, else the first one mapped."""
    found = [path for path in dict.fromkeys(line.split()[-1] for line in maps.splitlines()
                                            if "/" in line)
             if Path(path).name.startswith("libgomp") and ".so" in Path(path).name]
    homes = (f"{package}/", f"{package.parent / 'torch.libs'}/")  # torch/lib, a wheel's
    return next((p for p in found if p.startswith(homes)), found[0] if found else None)


def compiler(variable: str, names: tuple[str, ...], language: str) -> tuple[str, str]:
    """The compiler ``$variable`` names, else the first of ``names`` on PATH, and what its
    ``--version`` says (``RuntimeError``: none)."""
    found = os.environ.get(variable) or next(filter(None, map(shutil.which, names)), None)
    if found is None:
        raise RuntimeError(f"no {language} compiler ({', '.join(names)}) on PATH")
    return found, subprocess.run([found, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout


def _built() -> Path:
    cc, version = compiler("CC", ("cc", "gcc"), "C")
    runtime = openmp_runtime()
    # (sqrt as one instruction; no fused multiply-add: the fold repeats torch's float32 ops)
    flags = ["-O3", "-fPIC", "-fno-math-errno", "-ffp-contract=off"]
    key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + str(runtime).encode()
                         + " ".join(flags).encode()).hexdigest()[:16]
    folder = cache_dir()
    target = folder / f"rows-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # then one atomic rename
        built = Path(tmp) / target.name
        if runtime is None or not _built_threaded_into(built, cc, flags, runtime):
            _compile([cc, *flags, "-shared", "-o", str(built), str(SOURCE)])
        os.replace(built, target)
    return target


def _built_threaded_into(built: Path, compiler: str, flags: list[str], runtime: str) -> bool:
    """Build ``built`` with OpenMP, linked to ``runtime`` (compiled, then linked to that
    file alone: the compiler's own ``-lgomp`` would load a second runtime); ``False``
    where the compiler cannot."""
    obj = built.with_suffix(".o")
    try:
        _compile([compiler, *flags, "-fopenmp", "-c", "-o", str(obj), str(SOURCE)])
        _compile([compiler, "-shared", "-o", str(built), str(obj), runtime,
                  f"-Wl,-rpath,{Path(runtime).parent}"])
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("normwatch: native kernel built single-threaded (%s)", exc)
        return False
    return True


def _compile(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=120)


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


def pointers(tensors: Sequence[torch.Tensor]) -> ctypes.Array[ctypes.c_void_p]:
    """The tensors' data pointers, as a C array (the tensors must outlive its use)."""
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))


def fold_rows(rows: Sequence[torch.Tensor], table: torch.Tensor, full: bool,
              fp16_limit: float, common_tol: float, score0: float,
              columns: ctypes.Array[ctypes.c_int64], out: torch.Tensor) -> bool:
    """Fold staged calls' float32 rows (each contiguous, laid out as
    :class:`~normwatch.measure.reductions.CallRows` says) into ``out``'s lines (``(calls,
    width)`` float64 on the CPU, at the reduction identities), in one call: the
    arithmetic of :func:`~normwatch.measure.reductions.fold_calls` (``table``: its
    per-call constants, ``columns``: where each result goes; see ``normwatch_fold`` in
    the C source). ``False`` where there is no library."""
    lib = library()
    if lib is None:
        return False
    lib.normwatch_fold(len(rows), pointers(rows), table.data_ptr(), int(full), fp16_limit,
                       common_tol, score0, columns, out.shape[1], out.data_ptr())
    return True


def accumulate(lines: torch.Tensor, rows: torch.Tensor, n_sum: int, max_end: int,
               block: torch.Tensor) -> bool:
    """Fold ``lines`` (``(calls, columns)`` float64, a fold's) into ``block`` (the state,
    float64) at each call's row (``rows``, int64), all contiguous on the CPU, in one call:
    the first ``n_sum`` columns added, then the max up to ``max_end``, then the min, a
    NaN line value skipped (see ``normwatch_accumulate``). ``False`` where it cannot
    (another device or layout, no library): nothing done."""
    lib = library()
    f64 = torch.float64
    if lib is None or lines.dtype != f64 or block.dtype != f64 or rows.dtype != torch.int64 \
            or not (lines.is_cpu and block.is_cpu and rows.is_cpu) \
            or not (lines.is_contiguous() and block.is_contiguous() and rows.is_contiguous()) \
            or lines.dim() != 2 or block.dim() != 2 or lines.shape[1] != block.shape[1] \
            or rows.numel() != lines.shape[0]:
        return False
    lib.normwatch_accumulate(lines.shape[0], lines.data_ptr(), lines.shape[1], rows.data_ptr(),
                             n_sum, max_end, block.data_ptr())
    return True


def fold_grad_rows(rows: Sequence[torch.Tensor], table: torch.Tensor,
                   weights: Sequence[torch.Tensor], at: torch.Tensor,
                   block: torch.Tensor) -> bool:
    """Fold staged gradients (each one's rows as :func:`grad_rows` gives them: its token
    norms, then its min and max, float32 and contiguous) and weight gradients' norms
    (``weights``, one float32 each) into ``block`` (float64, contiguous, on the CPU) in
    one call: the arithmetic of :func:`~normwatch.measure.gradients.fold_grads`
    (``table``: each gradient's token count and where it goes; ``at``: where each weight
    gradient goes; see ``normwatch_fold_grads`` in the C source). ``False`` where there
    is no library."""
    lib = library()
    if lib is None:
        return False
    lib.normwatch_fold_grads(len(rows), pointers(rows), table.data_ptr(), len(weights),
                             pointers(weights), at.data_ptr(), block.data_ptr())
    return True


INTEGERS = {torch.int64: 0, torch.int32: 1}
"""The integer dtypes :func:`batch_hash` reads."""


def batch_hash(t: torch.Tensor) -> int | None:
    """The replay log's hash of ``t`` (:func:`~normwatch.measure.replay.hashed`: a CPU
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


def allocated(shape: tuple[int, ...]) -> torch.Tensor:
    """A new float32 CPU buffer of ``shape``: where rows are read when none is lent."""
    return torch.empty(shape, dtype=torch.float32)


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
        run this body themselves: see :data:`TAKE`)."""
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


TAKE = RowBuffers.take
"""The lender's method as defined here: where a lender's is still it, the C++ lanes
(:func:`~normwatch.measure.fastlane.state`'s ``own``) run its common case themselves,
with no frame."""


class RowReader:
    """:func:`row_stats` for one layer's calls whose input and output are alike (the
    same shape, contiguous, on the CPU): their layout worked out once (:func:`row_plan`),
    then each call one call of the kernel, into a buffer of ``take``'s (a lender's, or
    :func:`allocated`; the checks of a general call cost several times the call's own
    Python)."""

    __slots__ = ("_planned", "_take")

    def __init__(self, take: Callable[[tuple[int, ...]], torch.Tensor] = allocated) -> None:
        self._take = take
        self._planned: dict[str | None, tuple[tuple[object, ...], RowPlan | None]] = {}
        """Per moments (each tier's: a layer's calls switch tiers every few steps), the
        last layout met and its plan, as one pair (swapped whole: a call on another
        thread never reads another layout's plan)."""

    def __call__(self, x: torch.Tensor, out: torch.Tensor,
                 moments: str | None = None) -> torch.Tensor | None:
        """The rows of ``x`` and ``out`` (:func:`row_stats`), or ``None``: not alike, or
        left to torch's reductions."""
        if type(x) is not torch.Tensor or type(out) is not torch.Tensor or not x.is_cpu \
                or not out.is_cpu or x.layout != torch.strided or out.layout != torch.strided \
                or not x.is_contiguous() or not out.is_contiguous() \
                or _wrapped(x) or _wrapped(out):
            return None
        key = (x.shape, out.shape, x.dtype, out.dtype, torch.get_num_threads())
        planned = self._planned.get(moments)
        if planned is None or key != planned[0]:
            planned = self._planned[moments] = (
                key, row_plan(x, out, moments) if out.shape == x.shape else None)
        plan = planned[1]
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
                   whole: bool = False) -> ctypes.Array[ctypes.c_int64] | None:
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


def read_grad(plan: ctypes.Array[ctypes.c_int64], a: torch.Tensor, b: torch.Tensor | None,
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
    layout kept (the checks and argument conversions of a general call cost several
    times the call's own Python inside a backward), the rows put in a buffer of
    ``take``'s (a lender's, or :func:`allocated`)."""

    __slots__ = ("_planned", "_take", "_whole")

    def __init__(self, whole: bool = False,
                 take: Callable[[tuple[int, ...]], torch.Tensor] = allocated) -> None:
        self._whole = whole
        self._take = take
        self._planned: tuple[tuple[object, ...], ctypes.Array[ctypes.c_int64] | None] | None \
            = None
        """The last layout met and its plan (one pair, swapped whole)."""

    def __call__(self, a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor | None:
        """The rows of ``a`` (and ``b``) (:func:`grad_rows`), or ``None``: left to torch's
        reductions."""
        if type(a) is not torch.Tensor or not a.is_cpu or a.layout != torch.strided \
                or not a.is_contiguous() or _wrapped(a) or (b is not None and (
                    type(b) is not torch.Tensor or not b.is_cpu or b.layout != torch.strided
                    or not b.is_contiguous() or _wrapped(b))):
            return None if self._whole else grad_rows(a, b)
        key = (a.shape, a.dtype, None if b is None else (b.shape, b.dtype),
               torch.get_num_threads())
        planned = self._planned
        if planned is None or key != planned[0]:
            planned = self._planned = (key, grad_read_plan(a, b, self._whole))
        plan = planned[1]
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
        self._planned: tuple[tuple[object, ...], ctypes.Array[ctypes.c_int64] | None] | None \
            = None

    @staticmethod
    def covers(x: torch.Tensor, weight: object) -> bool:
        """Whether a norm's input ``x`` and ``weight`` (``None``: none) are read here: a
        plain float32 tensor, contiguous, on the CPU; a weight the same, one per element
        of ``x``'s last dim; and the library is built."""
        f32 = torch.float32
        return type(x) is torch.Tensor and x.dtype == f32 and x.is_cpu \
            and x.layout == torch.strided and x.is_contiguous() and not _wrapped(x) and (
                weight is None or (isinstance(weight, torch.Tensor) and weight.dtype == f32
                and weight.is_cpu and weight.layout == torch.strided
                and weight.is_contiguous() and weight.numel() == x.shape[-1]
                and not _wrapped(weight))) and library() is not None

    def __call__(self, g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(g's rows, dL/dx's rows)``, or ``None``: left to torch (``x`` and ``weight``
        as :meth:`covers` takes them)."""
        if type(g) is not torch.Tensor or g.dtype != torch.float32 or not g.is_cpu \
                or g.layout != torch.strided or not g.is_contiguous() or g.shape != x.shape \
                or (weight is not None and not weight.untyped_storage().nbytes()):
            return None  # (a weight whose storage was let go: FSDP2's, resharded)
        key = (g.shape, torch.get_num_threads())
        planned = self._planned
        if planned is None or key != planned[0]:
            planned = self._planned = (key, self.plan(g))
        plan = planned[1]
        if plan is None:
            return None
        rows = plan[0] + 2
        dg, din = self._take((rows,)), self._take((rows,))
        library().normwatch_through(  # type: ignore[union-attr]
            g.data_ptr(), x.data_ptr(), None if weight is None else weight.data_ptr(),
            dg.data_ptr(), din.data_ptr(), plan, self._eps)
        return dg, din

    def plan(self, g: torch.Tensor) -> ctypes.Array[ctypes.c_int64] | None:
        """``normwatch_through``'s plan for gradients laid out as ``g`` (``None``: left
        to torch)."""
        lib = library()
        threads = 0 if lib is None or not g.dim() else _threads(g, None)
        if lib is None or not threads or not g.numel():
            return None
        width = g.shape[-1]
        args = (g.numel() // width, width, self._centred, self._plus, threads)
        return (ctypes.c_int64 * len(args))(*args)
