"""The native folds: a step's staged calls and gradients folded by one call of the C
library each, and the lines accumulated into the state by another (~1 ms of torch's ops
on the CPU become a few µs). The same float32 arithmetic as torch's folds
(:mod:`~normwatch.measure.state.fold`, :mod:`~normwatch.measure.state.grad_fold`); where
the rows are not the C readers' (another dtype, a layout, a tensor key), ``None`` or
``False``: torch's.
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Sequence
from typing import cast

import torch

from normwatch.catalog import COLUMNS, SCORE_BASE
from normwatch.measure.backends.native.build import library, pointers
from normwatch.measure.state.fold import FoldPlan
from normwatch.measure.state.grad_fold import GradPlan
from normwatch.measure.state.rows import WEIGHT, CallRows, GradRows

_FOLDED = ("calls", "tokens", "finite_tokens", "fp16_overflow_tokens", "nonfinite",
           "out_nonfinite", "absmax", "out_absmax", "first_arrived_score", "first_born_score",
           "stats_tokens", "common_mode_tokens", "eps_dominated_tokens", "rms_sum", "rms_max",
           "rms_min", "common_mode_max", "sumsq_max", "eps_dominance")
"""The columns the C fold writes, in its order (``F_...`` in the C source)."""


_FOLDED_AT = (ctypes.c_int64 * len(_FOLDED))(*(COLUMNS.index(name) for name in _FOLDED))


def folded_calls(calls: Sequence[CallRows], plan: FoldPlan) -> torch.Tensor | None:
    """:func:`~normwatch.measure.state.fold.fold_calls` in one call of the C kernel
    (:func:`fold_rows`: a few dozen torch ops over every staged token cost ~1 ms on the
    CPU, the kernel a few µs), for CPU calls whose rows are float32 and contiguous, with
    float keys and no output of another shape; else ``None``. The same values as torch's
    ops (the same float32 arithmetic), but ``rms_sum``: summed in float64 there."""
    if plan.table is None:
        return None
    rows = list(map(_rows, calls))  # (each check over every call at once, in C: a loop
    # of Python over a few hundred calls costs more than the fold)
    if set(map(_dtype, rows)) != _FLOAT32 or set(map(_out, calls)) != _NONE \
            or not all(map(torch.Tensor.is_contiguous, rows)) \
            or list(map(torch.Tensor.numel, rows)) != plan.sizes:
        return None  # (the kernel reads each call's rows as plan.sizes says)
    out = plan.identity.t().contiguous()
    limits = plan.limits
    done = fold_rows(rows, plan.table, calls[0].full,
                     limits.fp16_limit, limits.common_mode_tol,
                     SCORE_BASE - cast(float, calls[0].key), _FOLDED_AT, out)
    return out if done else None


_rows, _dtype, _out = (operator.attrgetter(a) for a in ("v", "dtype", "out"))
_norms, _lo, _is_cpu = (operator.attrgetter(a) for a in ("norms", "lo", "is_cpu"))
_FLOAT32, _NONE = {torch.float32}, {None}


def folded_grads(block: torch.Tensor, staged: Sequence[GradRows], plan: GradPlan) -> bool:
    """:func:`~normwatch.measure.state.grad_fold.fold_grads` in one call of the C kernel
    (:func:`fold_grad_rows`; a couple of dozen torch ops cost ~0.7 ms a step on the CPU), for
    packed rows (the C kernel's), float32 weight norms and a float64 block on the CPU;
    ``False`` (nothing folded) otherwise. The same values, but the sums of squares across
    tokens: float64 there (no overflow past float32's range), float32 in torch's."""
    if plan.table is None or plan.weights_at is None or block.dtype != torch.float64 \
            or not block.is_contiguous():
        return False
    acts = [s for s in staged if s.site != WEIGHT]
    weights = [s.norms for s in staged if s.site == WEIGHT]
    # (each check over every gradient at once, in C: a loop of Python costs more)
    norms = list(map(_norms, acts))  # activations' gradients: packed where lo is None
    if set(map(_lo, acts)) - _NONE or set(map(_dtype, norms)) - _FLOAT32 \
            or not all(map(torch.Tensor.is_contiguous, norms)) \
            or set(map(torch.Tensor.dim, norms)) - {1}:
        return False  # (the plan's token counts are the rows' sizes: its signature)
    if set(map(_dtype, weights)) - _FLOAT32 or set(map(torch.Tensor.numel, weights)) - {1, 3} \
            or not all(map(_is_cpu, weights)) \
            or not all(map(torch.Tensor.is_contiguous, weights)):
        return False  # (the C fold reads each weight's first value: its norm)
    return fold_grad_rows(norms, plan.table, weights, plan.weights_at, block)


def fold_rows(rows: Sequence[torch.Tensor], table: torch.Tensor, full: bool,
              fp16_limit: float, common_tol: float, score0: float,
              columns: ctypes.Array[ctypes.c_int64], out: torch.Tensor) -> bool:
    """Fold staged calls' float32 rows (each contiguous, laid out as
    :class:`~normwatch.measure.state.rows.CallRows` says) into ``out``'s lines (``(calls,
    width)`` float64 on the CPU, at the reduction identities), in one call: the
    arithmetic of :func:`~normwatch.measure.state.fold.fold_calls` (``table``: its
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
    one call: the arithmetic of :func:`~normwatch.measure.state.grad_fold.fold_grads`
    (``table``: each gradient's token count and where it goes; ``at``: where each weight
    gradient goes; see ``normwatch_fold_grads`` in the C source). ``False`` where there
    is no library."""
    lib = library()
    if lib is None:
        return False
    lib.normwatch_fold_grads(len(rows), pointers(rows), table.data_ptr(), len(weights),
                             pointers(weights), at.data_ptr(), block.data_ptr())
    return True
