"""The Triton backend: one fused pass per norm call and per gradient (CUDA; anywhere in
Triton's interpreter, ``TRITON_INTERPRET=1``), torch's ops for the rest.

    >>> rows = row_stats_triton(tokens, out_tokens, full=True)   # (7, tokens) float32
    >>> call = TRITON.call_rows(layer, x, y, key, full=True)
    >>> rows, _, _ = TRITON.grad_rows(layer, site, g, part)      # (2, tokens) float32

The step's folds are kernels too (:mod:`~normwatch.measure.backends.triton_folds`), and
the optimizer side's: the update monitor's sample and the guard's check
(:mod:`~normwatch.measure.backends.triton_optimizer`).

Each program reads :data:`TOKENS` tokens of the input (and of the output, when given)
exactly once, in chunks of ``BLOCK_D`` elements, and writes the rows every backend writes
(:class:`~normwatch.measure.state.rows.CallRows`): max |x| for both the max and the min
(NaN where the token holds a NaN or an inf), the output's the same, then (``full``) the
sum, the L2 norm and the spread over the token (Chan's parallel merge of per-chunk
two-pass moments: stable at |mean|/std = 1e3). So a fused call is folded as any other.
A chunk's reductions are few, since each costs the program a round through shared
memory: one max gives max |x| and tells whether the token is finite (a NaN counted as
inf), a chunk's count is its width (a token that is not finite has NaN rows, whatever
was summed), and what a chunk reduces alike goes in one reduction of a tuple (the
input's and the output's max, read in one loop, the sum and the squares): 2 a chunk on
the full tier, 1 on the sentinel tier, 1 for a gradient (were 8, 4 and 3).
A gradient's program reads :data:`TOKENS` tokens of it (adding a second part as it
reads) and writes each one's L2 norm and max |g| (NaN where it holds a NaN or an inf): the rows of
:attr:`~normwatch.measure.state.rows.GradRows.rowwise`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import torch

from normwatch.measure.backends.torchops import TorchBackend, out_rows
from normwatch.measure.backends.triton_folds import (
    accumulate_fused,
    fold_calls_fused,
    fold_grads_fused,
)
from normwatch.measure.backends.triton_launch import Launch, Spec, static_launch
from normwatch.measure.backends.triton_optimizer import TritonPack, check_step
from normwatch.measure.backends.triton_through import through_kernel
from normwatch.measure.state import buffers
from normwatch.measure.state.backend import Launcher, Sample
from normwatch.measure.state.fold import FoldPlan
from normwatch.measure.state.grad_fold import GradPlan
from normwatch.measure.state.rows import WEIGHT, CallRows, GradRows, LayerRows

MAX_BLOCK_D = 2048
TOKENS = 1
"""The tokens a program of the call and gradient kernels reads (``TOKENS``: a tile of
``TOKENS`` x ``BLOCK_D``); one until a GPU measures better (``tests/benchmarks/gpu.py
--parts bandwidth`` sweeps it)."""


@functools.cache
def available() -> bool:
    """Whether Triton imports (the kernel then runs on CUDA, or anywhere when interpreted)."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install
        return False
    return True


def interpreted() -> bool:
    """Whether Triton's CPU interpreter runs the kernel (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def usable() -> bool:
    """Whether the kernel can run here: Triton imports and a GPU driver is up, or Triton's
    CPU interpreter is on (``TRITON_INTERPRET=1``)."""
    return available() and (interpreted() or torch.cuda.is_available())


def row_count(has_out: bool, full: bool) -> int:
    """Rows per token: max and min, the output's, then sum, L2 norm and spread."""
    return 2 + 2 * has_out + 3 * full


def row_stats_triton(tokens: torch.Tensor, out: torch.Tensor | None = None, full: bool = True,
                     centred: bool = True) -> torch.Tensor:
    """Run the kernel on ``(tokens, elements)`` views (any strides); ``out`` must have the
    same shape as ``tokens``. Returns ``(k, tokens)`` float32 rows on their device (see
    the module docstring)."""
    if tokens.dim() != 2:
        raise ValueError(f"'tokens' must be 2-D (tokens, elements): got shape "
                         f"{tuple(tokens.shape)}")
    if out is not None and out.shape != tokens.shape:
        raise ValueError(f"'out' must have the shape of 'tokens' {tuple(tokens.shape)}: got "
                         f"{tuple(out.shape)}")
    n_tokens, width = tokens.shape
    rows = buffers.allocated((row_count(out is not None, full), n_tokens), tokens.device)
    y = out if out is not None else tokens
    launch(tokens, y, rows, n_tokens, width, (tokens.stride(0), tokens.stride(1),
                                              y.stride(0), y.stride(1)),
           out is not None, full, centred)
    return rows


def launch(x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor, n_tokens: int, width: int,
           strides: tuple[int, int, int, int], has_out: bool, full: bool, centred: bool,
           warps: int = 4, tokens: int = TOKENS) -> None:
    """One launch of the kernel: ``n_tokens`` tokens of ``width`` elements of ``x`` (and
    of ``y`` with ``has_out``) at ``strides`` (token, element; ``x``'s then ``y``'s) into
    ``rows`` (``(row_count, n_tokens)`` float32), by programs of ``warps`` warps reading
    ``tokens`` tokens each (the GPU benchmark tries others); no tensor op on the way (the
    host's whole cost of a call)."""
    if n_tokens == 0:
        return
    if not x.is_cuda:  # the interpreter copies its arguments through NumPy
        x, y = x.detach(), y.detach()
    block = min(MAX_BLOCK_D, 1 << max(width - 1, 0).bit_length())  # (_block's, no frame)
    _ROWS(-(-n_tokens // tokens), x, y, rows, n_tokens, width, *strides, HAS_OUT=has_out,
          FULL=full, CENTRED=centred, BLOCK_D=block, TOKENS=tokens, num_warps=warps)


def launch_grad(g: torch.Tensor, part: torch.Tensor | None, rows: torch.Tensor,
                n_tokens: int, width: int, tokens: int = TOKENS) -> None:
    """One launch of the gradient kernel: ``n_tokens`` contiguous tokens of ``width``
    elements of ``g`` (plus ``part``, laid out alike, added in float32) into ``rows``
    (``(2, n_tokens)`` float32: each token's L2 norm, then its max |g|); no tensor op on
    the way (``tokens``: a program's, as :func:`launch`'s)."""
    if n_tokens == 0:
        return
    if not g.is_cuda:  # the interpreter copies its arguments through NumPy
        g = g.detach()
        part = None if part is None else part.detach()
    block = min(MAX_BLOCK_D, 1 << max(width - 1, 0).bit_length())  # (_block's, no frame)
    _GRAD_ROWS(-(-n_tokens // tokens), g, g if part is None else part, rows, n_tokens,
               width, HAS_PART=part is not None, BLOCK_D=block, TOKENS=tokens)


def launch_through(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                   out_rows: torch.Tensor, in_rows: torch.Tensor, n_tokens: int, width: int,
                   eps: float, centred: bool, one_plus_w: bool) -> None:
    """One launch of the kernel of the gradient through a layer or RMS norm
    (:func:`~normwatch.measure.layer.gradients.through_formula`'s, in float32): from
    ``n_tokens`` contiguous tokens of ``width`` elements of the output's gradient ``g``
    and the input ``x`` (and ``weight``, one per element, as ``1 + w`` with
    ``one_plus_w``), each token's L2 norm and max |g| of ``g`` into ``out_rows`` and of
    the gradient through the norm into ``in_rows`` (``(2, n_tokens)`` float32 each, as
    :func:`launch_grad` writes them)."""
    if n_tokens == 0:
        return
    if not g.is_cuda:  # the interpreter copies its arguments through NumPy
        g, x = g.detach(), x.detach()
        weight = None if weight is None else weight.detach()
    block = min(MAX_BLOCK_D, 1 << max(width - 1, 0).bit_length())  # (_block's, no frame)
    _THROUGH(n_tokens, g, x, x if weight is None else weight, out_rows, in_rows, n_tokens,
             width, float(eps), HAS_W=weight is not None, ONE_PLUS_W=one_plus_w,
             CENTRED=centred, BLOCK_D=block)


def _block(width: int) -> int:
    """The chunk a program reads of a token of ``width`` at a time (``BLOCK_D``; the
    launches above write it out, a frame less a launch)."""
    return min(MAX_BLOCK_D, 1 << max(width - 1, 0).bit_length())


_sum_max: Any = None
_maxes: Any = None
_moments: Any = None
"""A chunk's reductions, made with the kernels (:func:`_combiners`; Triton finds a
kernel's helpers among its module's globals, its compiler and its interpreter both):
compiled, each one reduction of a tuple, one round through shared memory however many
values it carries; interpreted, each value by its own reduction (the interpreter runs a
tuple's combining function element by element, in Python: 20 s for a 512-token call,
against numpy's reductions)."""
_combine_sum_max: Any = None
_combine_maxes: Any = None
_combine_moments: Any = None
"""The combining functions of :data:`_sum_max`, :data:`_maxes` and :data:`_moments`."""


def _combiners(tuples: bool | None = None) -> None:
    """Define :data:`_sum_max`, :data:`_maxes` and :data:`_moments` (``tuples``: as
    compiled, reductions of tuples; ``None``: as where they run)."""
    global _sum_max, _maxes, _moments, _combine_sum_max, _combine_maxes, _combine_moments
    if tuples is None:
        if _moments is not None:
            return
        tuples = not interpreted()
    import triton
    import triton.language as tl

    @triton.jit
    def combine_sum_max(s0, a0, s1, a1):
        return s0 + s1, tl.maximum(a0, a1)

    @triton.jit
    def combine_maxes(a0, b0, a1, b1):
        return tl.maximum(a0, a1), tl.maximum(b0, b1)

    @triton.jit
    def combine_moments(a0, b0, s0, q0, a1, b1, s1, q1):
        return tl.maximum(a0, a1), tl.maximum(b0, b1), s0 + s1, q0 + q1

    _combine_sum_max, _combine_maxes, _combine_moments = \
        combine_sum_max, combine_maxes, combine_moments
    if tuples:
        @triton.jit
        def sum_max(s, a):
            return tl.reduce((s, a), 1, _combine_sum_max)

        @triton.jit
        def maxes(a, b):
            return tl.reduce((a, b), 1, _combine_maxes)

        @triton.jit
        def moments(a, b, s, q):
            return tl.reduce((a, b, s, q), 1, _combine_moments)
    else:  # plain functions: the interpreter patches Triton's language at each call of
        # a jitted one (1.3 ms)
        def sum_max(s, a):
            return tl.sum(s, 1), tl.max(a, 1)

        def maxes(a, b):
            return tl.max(a, 1), tl.max(b, 1)

        def moments(a, b, s, q):
            return tl.max(a, 1), tl.max(b, 1), tl.sum(s, 1), tl.sum(q, 1)

    _sum_max, _maxes, _moments = sum_max, maxes, moments


@functools.cache
def _grad_kernel() -> Any:
    import triton
    import triton.language as tl

    _combiners()

    @triton.jit
    def grad_rows_kernel(g_ptr, p_ptr, rows_ptr, n_tokens, width, HAS_PART: tl.constexpr,
                         BLOCK_D: tl.constexpr, TOKENS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
        live = row < n_tokens
        offs = tl.arange(0, BLOCK_D)
        inf = float("inf")
        sumsq = tl.zeros((TOKENS,), tl.float32)
        hi = tl.zeros((TOKENS,), tl.float32)
        for start in range(0, width, BLOCK_D):
            idx = start + offs
            inside = live[:, None] & (idx < width)[None, :]
            at = row[:, None] * width + idx[None, :]
            g = tl.load(g_ptr + at, mask=inside, other=0.0).to(tl.float32)
            if HAS_PART:  # added in float32, as the C kernel adds them
                g += tl.load(p_ptr + at, mask=inside, other=0.0).to(tl.float32)
            a = tl.abs(g)  # (a NaN counts as inf)
            c_sq, c_hi = _sum_max(g * g, tl.where(a == a, a, inf))
            sumsq += c_sq
            hi = tl.maximum(hi, c_hi)
        tl.store(rows_ptr + row, tl.sqrt(sumsq), mask=live)
        tl.store(rows_ptr + n_tokens + row, tl.where(hi == inf, float("nan"), hi), mask=live)

    return grad_rows_kernel


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    _combiners()

    @triton.jit
    def row_stats_kernel(x_ptr, y_ptr, rows_ptr, n_tokens, width, sxt, sxd, syt, syd,
                         HAS_OUT: tl.constexpr, FULL: tl.constexpr, CENTRED: tl.constexpr,
                         BLOCK_D: tl.constexpr, TOKENS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
        live = row < n_tokens
        offs = tl.arange(0, BLOCK_D)
        inf = float("inf")
        hi = tl.zeros((TOKENS,), tl.float32)
        out_hi = tl.zeros((TOKENS,), tl.float32)
        n = tl.zeros((), tl.float32)
        mean = tl.zeros((TOKENS,), tl.float32)
        m2 = tl.zeros((TOKENS,), tl.float32)
        sumsq = tl.zeros((TOKENS,), tl.float32)
        for start in range(0, width, BLOCK_D):
            idx = start + offs
            inside = live[:, None] & (idx < width)[None, :]
            x = tl.load(x_ptr + row[:, None] * sxt + idx[None, :] * sxd, mask=inside,
                        other=0.0).to(tl.float32)
            a = tl.abs(x)  # a NaN counts as inf: one max gives max |x| and says if finite
            a = tl.where(a == a, a, inf)
            b = a  # (the output's, where there is one)
            if HAS_OUT:
                y = tl.load(y_ptr + row[:, None] * syt + idx[None, :] * syd, mask=inside,
                            other=0.0)
                b = tl.abs(y.to(tl.float32))
                b = tl.where(b == b, b, inf)
            if FULL:  # (a token holding NaN or inf: NaN below whatever these sum)
                c_hi, c_out, c_sum, c_sq = _moments(a, b, x, x * x)
                c_n = tl.minimum(width - start, BLOCK_D).to(tl.float32)
                c_mean = c_sum / c_n
                dev = tl.where(inside, x - c_mean[:, None], 0.0)
                c_m2 = tl.sum(dev * dev, 1)
                sumsq += c_sq
                total = n + c_n
                delta = c_mean - mean
                mean += delta * c_n / total
                m2 += c_m2 + delta * delta * n * c_n / total
                n = total
            else:
                c_hi, c_out = _maxes(a, b)
            hi = tl.maximum(hi, c_hi)
            out_hi = tl.maximum(out_hi, c_out)
        nan = float("nan")
        bad = hi == inf
        absmax = tl.where(bad, nan, hi)
        tl.store(rows_ptr + row, absmax, mask=live)
        tl.store(rows_ptr + n_tokens + row, absmax, mask=live)
        at = 2
        if HAS_OUT:
            out_absmax = tl.where(out_hi == inf, nan, out_hi)
            tl.store(rows_ptr + 2 * n_tokens + row, out_absmax, mask=live)
            tl.store(rows_ptr + 3 * n_tokens + row, out_absmax, mask=live)
            at = 4
        if FULL:
            l2 = tl.sqrt(sumsq)
            spread = tl.sqrt(m2) if CENTRED else l2
            tl.store(rows_ptr + at * n_tokens + row, tl.where(bad, nan, mean * n), mask=live)
            tl.store(rows_ptr + (at + 1) * n_tokens + row, tl.where(bad, nan, l2), mask=live)
            tl.store(rows_ptr + (at + 2) * n_tokens + row, tl.where(bad, nan, spread),
                     mask=live)

    return row_stats_kernel


def _lane_rows(t: torch.Tensor, k: int
               ) -> tuple[tuple[int, int], object, torch.device] | None:
    """A launch lane's rows for ``t``'s tokens (its last dim): ``k`` rows a token, where
    the lender keeps them, the device (``None``: a device the kernel does not run on)."""
    if not (t.is_cuda or interpreted()):
        return None
    shape = (k, t.numel() // t.shape[-1])
    return shape, buffers.key(shape, t.device), t.device


class TritonBackend(TorchBackend):
    """A call's rows by the fused kernel (one launch); the rest by torch's ops."""

    name = "triton"

    def launcher(self) -> Launcher | None:
        return self

    def call_rows(self, layer: LayerRows, x: torch.Tensor, out: torch.Tensor | None,
                  key: float | torch.Tensor, full: bool) -> CallRows:
        if out is not None and layer.whole(x) and out.shape == x.shape and \
                x.is_contiguous() and out.is_contiguous():
            # the common case: one launch into a lent buffer, no tensor op (no view either)
            width = x.shape[-1]
            n = x.numel() // width
            v = layer.take((row_count(True, full), n), x.device)
            launch(x, out, v, n, width, (width, 1, width, 1), True, full, layer.centred)
            return CallRows(layer.row, key, width, layer.eps, v, n, True, full, layer.centred,
                            None)
        tokens, out_tokens = layer.token_pair(x, out)
        tokens = tokens.reshape(-1, tokens.shape[-1])
        same = out_tokens is not None and out is not None and out.shape == x.shape
        if same:
            out_tokens = out_tokens.reshape(tokens.shape)  # type: ignore[union-attr]
        v = row_stats_triton(tokens, out_tokens if same else None, full, layer.centred)
        spare = out_rows(out_tokens) if out_tokens is not None and not same and \
            out_tokens.numel() else None
        return CallRows(layer.row, key, tokens.shape[1], layer.eps, v, tokens.shape[0], same,
                        full, layer.centred, spare)

    @staticmethod
    def lane_plan(x: torch.Tensor, y: torch.Tensor, full: bool, centred: bool
                  ) -> tuple[tuple[int, int], object, torch.device, Spec | None] | None:
        """A launch lane's plan of a call's layout (:mod:`~normwatch.measure.backends.
        native.lane`: asked once per layout and tier): its rows' shape, where the lender
        keeps them and the kernel's static launch (``None``: not a floating call, or a
        device the kernel does not run on: a model moved off CUDA)."""
        if not (x.is_floating_point() and y.is_floating_point() and x.device == y.device):
            return None
        where = _lane_rows(x, row_count(True, full))
        if where is None:
            return None
        width = x.shape[-1]
        n = where[0][1]
        return (*where, static_launch(
            _kernel(), (x.dtype, y.dtype, torch.float32, n, width, width, 1, width, 1),
            {"HAS_OUT": True, "FULL": full, "CENTRED": centred, "BLOCK_D": _block(width),
             "TOKENS": TOKENS}, -(-n // TOKENS), x.device))

    @staticmethod
    def lane_launch(x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor, n: int, width: int,
                    full: bool, centred: bool) -> None:
        """A launch lane's read of a call planned by :meth:`lane_plan` (contiguous
        tokens of ``width``, lined up) into ``rows``, as :meth:`call_rows`' common case."""
        launch(x, y, rows, n, width, (width, 1, width, 1), True, full, centred)

    @staticmethod
    def lane_grad_plan(g: torch.Tensor) -> tuple[tuple[int, int], object, torch.device,
                                                  tuple[Spec | None, Spec | None]] | None:
        """A launch lane's plan of a gradient's layout, as :meth:`lane_plan`'s, with two
        static launches: a gradient alone, and with a second part laid out alike."""
        where = _lane_rows(g, 2)
        if where is None:
            return None
        width = g.shape[-1]
        n = where[0][1]
        return (*where, tuple(static_launch(  # type: ignore[return-value]
            _grad_kernel(), (g.dtype, g.dtype, torch.float32, n, width),
            {"HAS_PART": part, "BLOCK_D": _block(width), "TOKENS": TOKENS}, -(-n // TOKENS),
            g.device) for part in (False, True)))

    @staticmethod
    def lane_through_plan(layer: LayerRows, g: torch.Tensor, x: torch.Tensor,
                          weight: torch.Tensor | None
                          ) -> tuple[tuple[int, int], object, torch.device, Spec | None] | None:
        """A launch lane's plan of a compiled output gradient ``g`` with the one through
        the norm (from ``x`` and ``weight``: a float32 one, or none), as
        :meth:`lane_plan`'s: each of its two rows' shape, their lender's key, the device,
        the static launch of :func:`launch_through` (``None``: none, :meth:`through_rows`
        reads it)."""
        if g.shape != x.shape or g.dtype != x.dtype or not TRITON.covers_through(
                layer, x, weight) or (weight is not None and weight.dtype != torch.float32):
            return None
        where = _lane_rows(g, 2)
        if where is None:
            return None
        width = g.shape[-1]
        n = where[0][1]
        return (*where, static_launch(
            through_kernel(), (g.dtype, x.dtype, torch.float32 if weight is not None
                                else x.dtype, torch.float32, torch.float32, n, width,
                                float(layer.eps)),
            {"HAS_W": weight is not None, "ONE_PLUS_W": layer.one_plus_w,
             "CENTRED": layer.centred, "BLOCK_D": _block(width)}, n, g.device))

    @staticmethod
    def lane_grad_launch(g: torch.Tensor, part: torch.Tensor | None, rows: torch.Tensor,
                         n: int, width: int) -> None:
        """A launch lane's read of a gradient planned by :meth:`lane_grad_plan`
        (contiguous tokens of ``width``; ``part``: a second part, laid out alike, added)
        into ``rows``, as :meth:`grad_rows`' common case."""
        launch_grad(g, part, rows, n, width)

    def covers_through(self, layer: LayerRows, x: torch.Tensor, weight: object) -> bool:
        if weight is not None and not (type(weight) in (torch.Tensor, torch.nn.Parameter)
                                       and isinstance(weight, torch.Tensor)):
            return False  # (a DTensor's: torch's formula)
        return layer.kind in ("layernorm", "rmsnorm") and x.is_floating_point() and \
            x.dim() > 0 and x.is_contiguous() and x.shape[-1] == layer.width and \
            (x.is_cuda or interpreted()) and (weight is None or (
                weight.is_floating_point() and weight.is_contiguous()
                and weight.numel() == x.shape[-1] and weight.device == x.device))

    def through_rows(self, layer: LayerRows, g: torch.Tensor, x: torch.Tensor,
                     weight: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        # one launch into two lent buffers, each token's norm then its max |g|: of the
        # output's gradient, of the gradient through the norm
        if g.shape != x.shape or not g.is_contiguous() or not g.is_floating_point():
            return None
        width = x.shape[-1]
        n = x.numel() // width
        rows = layer.grad_take((2, n), g.device), layer.grad_take((2, n), g.device)
        launch_through(g, x, weight, *rows, n, width, layer.eps, layer.centred,
                       layer.one_plus_w)
        return rows

    def grad_rows(self, layer: LayerRows, site: int, g: torch.Tensor,
                  part: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        if site != WEIGHT and g.dim() and g.is_contiguous() and (part is None or (
                part.shape == g.shape and part.dtype == g.dtype and part.is_contiguous())):
            # one launch into a lent buffer: each token's norm, then its max |g|
            width = g.shape[-1]
            n = g.numel() // width if width else 0
            if n:
                v = layer.grad_take((2, n), g.device)
                launch_grad(g, part, v, n, width)
                return v, None, None
        return super().grad_rows(layer, site, g, part)

    def fold(self, calls: Sequence[CallRows], plan: FoldPlan) -> torch.Tensor:
        lines = fold_calls_fused(calls, plan)
        return super().fold(calls, plan) if lines is None else lines

    def accumulate(self, lines: torch.Tensor, rows: torch.Tensor, block: torch.Tensor
                   ) -> None:
        if not accumulate_fused(lines, rows, block):
            super().accumulate(lines, rows, block)

    def fold_grads(self, block: torch.Tensor, staged: Sequence[GradRows], plan: GradPlan
                   ) -> None:
        if not fold_grads_fused(block, staged, plan):
            super().fold_grads(block, staged, plan)

    def sample(self, samples: list[torch.Tensor], scales: list[float]) -> Sample | None:
        return TritonPack.make(samples, scales) if samples[0].is_cuda or interpreted() \
            else None

    def check(self, rows: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
              ) -> torch.Tensor | None:
        first = grads[0] if grads else rows[0] if rows else None
        return None if first is None or not (first.is_cuda or interpreted()) else \
            check_step(rows, grads)


TRITON = TritonBackend()


_ROWS, _GRAD_ROWS, _THROUGH = Launch(_kernel), Launch(_grad_kernel), Launch(through_kernel)
