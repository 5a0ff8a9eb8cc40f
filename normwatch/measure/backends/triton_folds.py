"""The Triton backend's folds: a step's staged rows into the per-layer state in a launch
or two, however many layers (CUDA; anywhere in Triton's interpreter).

    >>> lines = fold_calls_fused(calls, plan)          # one program per call: its line
    >>> accumulate_fused(lines, plan.rows, block)      # one program per layer row
    >>> fold_grads_fused(block, staged, grad_plan)     # one program per block cell

Each kernel does what the torch fold it stands for does, in the same float32 arithmetic
(:func:`~normwatch.measure.state.fold.fold_calls`, the torch backend's ``accumulate``,
:func:`~normwatch.measure.state.grad_fold.fold_grads`), and says ``False`` (or
``None``) where it does not cover its input, which torch's ops then fold. Every program
owns what it writes (a call's line, a layer's row, a block cell), so two calls or two
backward passes that land in one row never race, and no atomics are needed.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

import torch

from normwatch.catalog import COLUMNS, SCORE_BASE
from normwatch.measure.backends.triton_launch import Launch
from normwatch.measure.state.accumulator import MAX_END, N_SUM
from normwatch.measure.state.fold import FoldPlan, gathered
from normwatch.measure.state.grad_fold import GradPlan
from normwatch.measure.state.rows import CallRows, GradRows

MAX_BLOCK = 2048
FOLDED = ("calls", "tokens", "finite_tokens", "fp16_overflow_tokens", "nonfinite",
          "out_nonfinite", "absmax", "out_absmax", "stats_tokens", "common_mode_tokens",
          "eps_dominated_tokens", "rms_sum", "rms_max", "rms_min", "common_mode_max",
          "sumsq_max", "eps_dominance", "first_arrived_score", "first_born_score")
"""The columns a call's fold writes (in the kernel's order); the rest keep their
identities."""
_AT: dict[torch.device, torch.Tensor] = {}


def _columns(device: torch.device) -> torch.Tensor:
    """:data:`FOLDED`'s places in :data:`~normwatch.catalog.COLUMNS` on ``device`` (made
    once, by fill kernels)."""
    at = _AT.get(device)
    if at is None:
        at = _AT[device] = torch.cat([torch.full((1,), COLUMNS.index(c), dtype=torch.int64,
                                                 device=device) for c in FOLDED])
    return at


def _block(n: int) -> int:
    import triton

    return min(MAX_BLOCK, int(triton.next_power_of_2(max(n, 1))))


def fold_calls_fused(calls: Sequence[CallRows], plan: FoldPlan) -> torch.Tensor | None:
    """The staged calls' lines (as :func:`~normwatch.measure.state.fold.fold_calls`), one
    program per call; ``None`` where the kernel does not cover them (an output that does
    not line up, a compiled call's tensor key)."""
    key = calls[0].key
    if plan.consts is None or not plan.aligned or not isinstance(key, float) or \
            not key.is_integer():
        return None
    v = gathered(calls, plan)
    lines = torch.empty(len(calls), len(COLUMNS), dtype=torch.float64, device=v.device)
    launch_calls(v, plan.consts, plan.identity, _columns(v.device), lines,
                 (int(SCORE_BASE - key), plan.limits.fp16_limit, plan.limits.common_mode_tol),
                 calls[0].full)
    return lines


def launch_calls(v: torch.Tensor, consts: torch.Tensor, identity: torch.Tensor,
                 at: torch.Tensor, lines: torch.Tensor, scalars: tuple[int, float, float],
                 full: bool) -> None:
    """One launch of the calls' fold: the gathered rows ``v`` (``(k, tokens)``), the
    plan's ``consts`` and ``identity``, :data:`FOLDED`'s places ``at``, into ``lines``;
    ``scalars``: the first call's score base (an integer below 2**52: exact as a kernel's
    integer argument, where a float one is float32), the fp16 limit and the common-mode
    tolerance."""
    if not v.is_cuda:  # the interpreter copies its arguments through NumPy
        v = v.detach()
    n_calls, n_tokens = lines.shape[0], v.shape[1]
    _FOLD_CALLS(n_calls, v, consts, identity, at, lines, n_tokens, n_calls, len(COLUMNS),
                *scalars, FULL=full, BLOCK_T=_block(n_tokens // max(n_calls, 1)),
                BLOCK_C=_block(len(COLUMNS)))


def accumulate_fused(lines: torch.Tensor, rows: torch.Tensor, block: torch.Tensor) -> bool:
    """Fold ``lines`` into ``block`` at ``rows`` (as the torch backend's ``accumulate``),
    one program per block row; ``False`` (nothing done) where the layouts are not the
    kernel's."""
    if lines.dtype != torch.float64 or block.dtype != torch.float64 or \
            not (lines.is_contiguous() and block.is_contiguous() and rows.is_contiguous()) \
            or lines.shape[1] != block.shape[1] or rows.dtype != torch.int64:
        return False
    launch_accumulate(lines, rows, block)
    return True


def launch_accumulate(lines: torch.Tensor, rows: torch.Tensor, block: torch.Tensor) -> None:
    """One launch of :func:`accumulate_fused`'s kernel."""
    if not block.is_cuda:
        lines = lines.detach()
    _ACCUMULATE(block.shape[0], lines, rows, block, lines.shape[0], block.shape[1],
                N_SUM=N_SUM, MAX_END=MAX_END, BLOCK_C=_block(block.shape[1]))


@functools.cache
def _calls_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def fold_calls_kernel(v_ptr, consts_ptr, identity_ptr, at_ptr, lines_ptr, total,
                          n_calls, n_cols, score_base, fp16_limit, common_tol,
                          FULL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        c = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_T)
        inf = float("inf")
        k = consts_ptr + c * 8
        start = tl.load(k).to(tl.int64)
        n = tl.load(k + 1).to(tl.int64)
        width = tl.load(k + 2)
        eps = tl.load(k + 3).to(tl.float32)
        inv_w = tl.load(k + 4).to(tl.float32)
        inv_sqrt_w = tl.load(k + 5).to(tl.float32)
        below = tl.load(k + 6).to(tl.float32)
        offset = tl.load(k + 7)
        finite = tl.zeros((), tl.float32)
        fp16 = tl.zeros((), tl.float32)
        out_finite = tl.zeros((), tl.float32)
        absmax = tl.full((), -inf, tl.float32)
        out_absmax = tl.full((), -inf, tl.float32)
        common_n = tl.zeros((), tl.float32)
        eps_n = tl.zeros((), tl.float32)
        rms_sum = tl.zeros((), tl.float32)
        rms_max = tl.full((), -inf, tl.float32)
        common_max = tl.full((), -inf, tl.float32)
        rms_min = tl.full((), inf, tl.float32)
        root_min = tl.full((), inf, tl.float32)
        for s in range(0, n, BLOCK_T):
            i = s + offs
            inside = i < n
            at = start + i
            # max |x| per token; NaN/inf (in either of its rows): not finite
            hi = tl.abs(tl.load(v_ptr + at, mask=inside, other=0.0))
            lo = tl.abs(tl.load(v_ptr + total + at, mask=inside, other=0.0))
            ok = inside & (hi < inf) & (lo < inf)
            peak = tl.where(ok, tl.maximum(hi, lo), -inf)
            finite += tl.sum(ok.to(tl.float32), 0)
            fp16 += tl.sum((peak > fp16_limit).to(tl.float32), 0)
            absmax = tl.maximum(absmax, tl.max(peak, 0))
            hi = tl.abs(tl.load(v_ptr + 2 * total + at, mask=inside, other=0.0))
            lo = tl.abs(tl.load(v_ptr + 3 * total + at, mask=inside, other=0.0))
            ok = inside & (hi < inf) & (lo < inf)
            out_finite += tl.sum(ok.to(tl.float32), 0)
            out_absmax = tl.maximum(out_absmax, tl.max(tl.where(ok, tl.maximum(hi, lo), -inf),
                                                       0))
            if FULL:  # sum, L2 norm, spread: RMS, sqrt(mean square or variance), |mean|/RMS
                rms = tl.load(v_ptr + 5 * total + at, mask=inside, other=0.0) * inv_sqrt_w
                root = tl.load(v_ptr + 6 * total + at, mask=inside, other=0.0) * inv_sqrt_w
                mean = tl.abs(tl.load(v_ptr + 4 * total + at, mask=inside, other=0.0) * inv_w)
                common = mean / tl.where(rms != rms, rms, tl.maximum(rms, 1e-30))
                rms_ok = inside & (tl.abs(rms) < inf)
                root_ok = inside & (tl.abs(root) < inf)
                common_peak = tl.where(inside & (tl.abs(common) < inf), common, -inf)
                rms_max = tl.maximum(rms_max, tl.max(tl.where(rms_ok, rms, -inf), 0))
                common_max = tl.maximum(common_max, tl.max(common_peak, 0))
                rms_min = tl.minimum(rms_min, tl.min(tl.where(rms_ok, rms, inf), 0))
                root_low = tl.where(root_ok, root, inf)
                root_min = tl.minimum(root_min, tl.min(root_low, 0))
                common_n += tl.sum((common_peak > common_tol).to(tl.float32), 0)
                eps_n += tl.sum((root_low < below).to(tl.float32), 0)
                rms_sum += tl.sum(tl.where(rms_ok, rms, 0.0), 0)
        tokens = n.to(tl.float32)
        bad = tokens - finite
        out_bad = tokens - out_finite
        score = score_base.to(tl.float64) - offset
        cols = tl.arange(0, BLOCK_C)
        inside = cols < n_cols
        line = tl.load(identity_ptr + cols * n_calls + c, mask=inside, other=0.0)
        line = tl.where(cols == tl.load(at_ptr), 1.0, line)
        line = tl.where(cols == tl.load(at_ptr + 1), tokens, line)
        line = tl.where(cols == tl.load(at_ptr + 2), finite, line)
        line = tl.where(cols == tl.load(at_ptr + 3), fp16, line)
        line = tl.where(cols == tl.load(at_ptr + 4), bad, line)
        line = tl.where(cols == tl.load(at_ptr + 5), out_bad, line)
        line = tl.where(cols == tl.load(at_ptr + 6), absmax, line)
        line = tl.where(cols == tl.load(at_ptr + 7), out_absmax, line)
        if FULL:
            ratio = eps / (root_min * root_min + eps)
            ratio = tl.where(ratio != ratio, 1.0, ratio)  # eps = spread = 0: dominated
            top = rms_max.to(tl.float64)
            line = tl.where(cols == tl.load(at_ptr + 8), finite, line)
            line = tl.where(cols == tl.load(at_ptr + 9), common_n, line)
            line = tl.where(cols == tl.load(at_ptr + 10), eps_n, line)
            line = tl.where(cols == tl.load(at_ptr + 11), rms_sum, line)
            line = tl.where(cols == tl.load(at_ptr + 12), top, line)
            line = tl.where(cols == tl.load(at_ptr + 13), rms_min, line)
            line = tl.where(cols == tl.load(at_ptr + 14), common_max, line)
            line = tl.where(cols == tl.load(at_ptr + 15), top * tl.abs(top) * width, line)
            line = tl.where(cols == tl.load(at_ptr + 16), tl.where(finite > 0, ratio, -inf),
                            line)
        line = tl.where(cols == tl.load(at_ptr + 17), tl.where(bad > 0, score, 0.0), line)
        line = tl.where(cols == tl.load(at_ptr + 18),
                        tl.where((out_bad > 0) & (bad == 0), score, 0.0), line)
        tl.store(lines_ptr + c * n_cols + cols, line, mask=inside)

    return fold_calls_kernel


@functools.cache
def _accumulate_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def accumulate_kernel(lines_ptr, rows_ptr, block_ptr, n_calls, n_cols,
                          N_SUM: tl.constexpr, MAX_END: tl.constexpr, BLOCK_C: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_C)
        inside = cols < n_cols
        inf = float("inf")
        acc = tl.load(block_ptr + r * n_cols + cols, mask=inside, other=0.0)
        for c in range(0, n_calls):
            mine = tl.load(rows_ptr + c) == r
            line = tl.load(lines_ptr + c * n_cols + cols, mask=inside, other=0.0)
            nan = line != line  # NaN never beats a value
            kept = tl.where(cols < N_SUM, acc + line,
                            tl.where(cols < MAX_END, tl.maximum(acc, tl.where(nan, -inf, line)),
                                     tl.minimum(acc, tl.where(nan, inf, line))))
            acc = tl.where(mine, kept, acc)
        tl.store(block_ptr + r * n_cols + cols, acc, mask=inside)

    return accumulate_kernel


def fold_grads_fused(block: torch.Tensor, staged: Sequence[GradRows], plan: GradPlan
                     ) -> bool:
    """Fold staged gradients into ``block`` in one launch, each cell of the block by one
    program (:func:`~normwatch.measure.state.grad_fold.cell_table`), as
    :func:`~normwatch.measure.state.grad_fold.fold_grads` does (its arithmetic, each
    gradient's sums in float32); ``False`` where it does not cover them (the
    activations' gradients not all the kernel's rows alike, a weight's norm not 0-d, a
    block not contiguous: nothing done)."""
    # (the plan's places, read by C's getters: no Python a gradient, each step)
    acts = list(map(_norms, map(staged.__getitem__, plan.acts_at)))
    weights = list(map(_norms, map(staged.__getitem__, plan.weights_from)))
    shapes = set(map(_shape, acts))
    if plan.cells is None or not block.is_contiguous() or not plan.whole or \
            len(shapes) > 1 or any(len(shape) != 2 for shape in shapes) or \
            any(map(torch.Tensor.dim, weights)):
        return False
    rows = torch.stack(acts) if acts else block
    norms = torch.stack(weights) if weights else block
    n_tokens = acts[0].shape[1] if acts else 0
    n_layers = plan.n_layers
    n_cells = (plan.cells.numel() - len(acts) - len(weights) - 2 * n_layers - 2) // 3
    launch_grads(rows, plan.widths, norms, plan.cells, block,
                 (n_tokens, len(acts), n_cells, len(weights), n_layers))
    return True


_norms, _shape = operator.attrgetter("norms"), operator.attrgetter("shape")


def launch_grads(rows: torch.Tensor, widths: torch.Tensor, norms: torch.Tensor,
                 cells: torch.Tensor, block: torch.Tensor, counts: tuple[int, ...]) -> None:
    """One launch of the gradients' fold: ``rows`` (``(gradients, 2, tokens)``), their
    ``widths``, the weights' ``norms``, the plan's ``cells`` into ``block``; ``counts``:
    tokens per gradient, gradients, site cells, weights, weight cells."""
    if not block.is_cuda:  # the interpreter copies its arguments through NumPy
        rows, norms = rows.detach(), norms.detach()
    n_tokens, n_grads, n_cells, n_weights, n_layers = counts
    _FOLD_GRADS(n_cells + n_layers, rows, widths, norms, cells, block, n_tokens, n_grads,
                n_cells, n_weights, BLOCK_T=_block(n_tokens))


@functools.cache
def _grads_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def fold_grads_kernel(rows_ptr, widths_ptr, norms_ptr, table_ptr, block_ptr, n_tokens,
                          n_grads, n_cells, n_weights, BLOCK_T: tl.constexpr):
        k = tl.program_id(0)
        offs = tl.arange(0, BLOCK_T)
        inf = float("inf")
        if k < n_cells:  # a site's cell: its gradients' tokens, finite tokens, sums, peak
            tokens = tl.zeros((), tl.float64)
            finite = tl.zeros((), tl.float64)
            squares = tl.zeros((), tl.float64)
            elements = tl.zeros((), tl.float64)
            top = tl.full((), -inf, tl.float32)
            for j in range(tl.load(table_ptr + n_grads + k),
                           tl.load(table_ptr + n_grads + k + 1)):
                g = tl.load(table_ptr + j)
                base = rows_ptr + g * 2 * n_tokens
                peak = tl.zeros((), tl.float32)
                bad = tl.zeros((), tl.float32)
                for start in range(0, n_tokens, BLOCK_T):
                    inside = start + offs < n_tokens
                    p = tl.load(base + n_tokens + start + offs, mask=inside, other=0.0)
                    ok = p < inf  # (max |g| >= 0: NaN and inf are not below)
                    bad += tl.sum((inside & ~ok).to(tl.float32), 0)
                    peak = tl.maximum(peak, tl.max(tl.where(ok, p, 0.0), 0))
                whole = bad == 0
                count = tl.zeros((), tl.float32)
                summed = tl.zeros((), tl.float32)
                for start in range(0, n_tokens, BLOCK_T):
                    inside = start + offs < n_tokens
                    n = tl.load(base + start + offs, mask=inside, other=0.0)
                    ok = inside & ((n < inf).to(tl.int32) + whole.to(tl.int32) > 0)
                    count += tl.sum(ok.to(tl.float32), 0)
                    summed += tl.sum(tl.where(ok, n * n, 0.0), 0)
                tokens += n_tokens
                finite += count
                squares += summed
                elements += count * tl.load(widths_ptr + g)
                top = tl.where(whole, tl.maximum(top, peak), top)
            sums = block_ptr + tl.load(table_ptr + n_grads + n_cells + 1 + k)
            tl.store(sums, tl.load(sums) + tokens)
            tl.store(sums + 1, tl.load(sums + 1) + finite)
            tl.store(sums + 2, tl.load(sums + 2) + squares)
            tl.store(sums + 3, tl.load(sums + 3) + elements)
            at = block_ptr + tl.load(table_ptr + n_grads + 2 * n_cells + 1 + k)
            old = tl.load(at)
            tl.store(at, tl.where(old != old, top, tl.maximum(old, top)))  # (fmax)
        else:  # a layer's weight: its gradients' count and squared norms
            w = n_grads + 3 * n_cells + 1
            n_layers = (tl.num_programs(0) - n_cells).to(tl.int64)
            i = (k - n_cells).to(tl.int64)
            count = tl.zeros((), tl.float64)
            squares = tl.zeros((), tl.float64)
            for j in range(tl.load(table_ptr + w + n_weights + i),
                           tl.load(table_ptr + w + n_weights + i + 1)):
                n = tl.load(norms_ptr + tl.load(table_ptr + w + j)).to(tl.float64)
                count += 1.0
                squares += n * n
            at = block_ptr + tl.load(table_ptr + w + n_weights + n_layers + 1 + i)
            tl.store(at, tl.load(at) + count)
            tl.store(at + 1, tl.load(at + 1) + squares)

    return fold_grads_kernel


_FOLD_CALLS, _ACCUMULATE, _FOLD_GRADS = map(Launch, (_calls_kernel, _accumulate_kernel,
                                                    _grads_kernel))
