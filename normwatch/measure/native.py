"""Native CPU kernels: the sentinel in one pass (each token's max and min of a norm's
input and output, here), and the update monitor's sample (:mod:`~normwatch.measure.
native_updates`), from one C library built at first use.

    >>> rows = row_extremes(tokens, out)   # (4, tokens) float32, or None: use torch's

Torch's row reductions read an activation once per statistic (``amax`` and ``amin`` of
the input and of the output, then a ``stack``: five ops, four passes); this reads each
tensor once, vectorised, into one float32 buffer (exact: a max or a min is one of the
values), with NaN where a row holds one, as ``amax``/``amin`` give. The C source
(``native_rows.c``, shipped with the package) is compiled at first use with the
system's C compiler into a per-user cache (``$NORMWATCH_CACHE``, else
``$XDG_CACHE_HOME/normwatch`` or ``~/.cache/normwatch``), named by a hash of the source
and the compiler; without a compiler, or for what it does not cover (other dtypes, rows
that are not contiguous, tensors past :data:`MAX_ELEMENTS`, and float32 where torch's
reductions run on several threads: see :data:`GRAIN`), the caller uses torch's
reductions. Set ``NORMWATCH_NATIVE=0`` (or ``kernel="torch"``) to never use it.
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
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native_rows.c")
MAX_ELEMENTS = 1 << 21
"""The most elements per tensor read here (4 MiB of bf16): one thread; beyond, torch's
reductions split the rows over its threads."""
GRAIN = 32768
"""Torch's grain size: below it its reductions run on one thread too. Above it, float32
is left to them where torch has several threads: an activation a multi-threaded op just
wrote lies in several cores' caches, and their passes, each core reading its part, beat
one pass on one core there (measured: 146-194 µs against 181-196 µs for 512 x 256 after
the caches were flushed, 370 against 440 µs at 512 x 1024; bf16 and fp16, whose torch
reductions convert every element, 292 against 171 µs and 561 against 281 µs)."""
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
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    i64, ptrs = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_void_p)
    sample = lib.normwatch_sample  # normwatch.measure.native_updates
    sample.argtypes = [ctypes.c_int64, ctypes.c_int, i64, i64, i64,
                       ctypes.POINTER(ctypes.c_double), ptrs, ptrs, ctypes.c_void_p,
                       ctypes.c_int, ctypes.c_void_p]
    sample.restype = ctypes.c_int
    return lib


def _built() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + version.encode()).hexdigest()[:16]
    folder = cache_dir()
    target = folder / f"rows-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # then one atomic rename
        built = Path(tmp) / target.name
        subprocess.run([compiler, "-O3", "-shared", "-fPIC", "-o", str(built), str(SOURCE)],
                       check=True, capture_output=True, timeout=120)
        os.replace(built, target)
    return target


def _rowwise(t: torch.Tensor) -> tuple[int, int, int] | None:
    """``(rows, width, row stride)`` of ``t`` read as rows of its last dim, or ``None``
    when the kernel does not cover it."""
    if type(t) is not torch.Tensor or t.device.type != "cpu" or t.dtype not in KINDS \
            or t.layout != torch.strided or t.dim() == 0 or t.numel() > MAX_ELEMENTS \
            or not t.numel() or torch._C._functorch.is_functorch_wrapped_tensor(t):
        return None  # (vmap's and grad's wrappers have no data pointer)
    if t.dtype == torch.float32 and t.numel() > GRAIN and torch.get_num_threads() > 1:
        return None
    width = t.shape[-1]
    if t.is_contiguous():
        return t.numel() // width, width, width
    if t.dim() == 2 and t.stride(1) == 1:
        return t.shape[0], width, t.stride(0)
    return None


def row_extremes(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor | None:
    """``(2 or 4, *x.shape[:-1])`` float32: each row's max and min of ``x`` (then of
    ``out``, whose leading dims are ``x``'s), or ``None`` where torch's reductions must
    do it (see the module docstring)."""
    shape_x = _rowwise(x)
    shape_out = None if out is None else _rowwise(out)
    if shape_x is None or (out is not None and shape_out is None):
        return None
    lib = library()  # only once a tensor it covers comes: no compiler run for CUDA ones
    if lib is None:
        return None
    rows = torch.empty(2 if out is None else 4, *x.shape[:-1], dtype=torch.float32)
    fn, n, ptr = lib.normwatch_rows, shape_x[0], rows.data_ptr()
    fn(x.data_ptr(), KINDS[x.dtype], *shape_x, ptr)
    if out is not None and shape_out is not None:
        fn(out.data_ptr(), KINDS[out.dtype], *shape_out, ptr + 8 * n)
    return rows
