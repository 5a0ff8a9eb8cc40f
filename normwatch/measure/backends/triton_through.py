"""The kernel of the gradient through a layer or RMS norm, compiled code's (which cannot
hook the norm's own autograd nodes: the formula's,
:func:`~normwatch.measure.layer.gradients.through_formula`, in float32), launched by
:func:`~normwatch.measure.backends.triton_kernel.launch_through`.

One program a token of the output's gradient ``g`` and the input ``x`` (and the weight):
a pass for the means (LayerNorm's) and ``g``'s rows, one for the sums, one for ``dx``;
it writes each token's L2 norm and max |g| (NaN where it holds a NaN or an inf) of ``g``
and of ``dx``, the rows :attr:`~normwatch.measure.state.rows.GradRows.rowwise` names.
"""

from __future__ import annotations

import functools
from typing import Any

_read_scaled: Any = None
"""A chunk of a token: ``(g, x, w·g)`` in float32 (made with the kernel: a global, where
Triton finds a kernel's helpers)."""


@functools.cache
def through_kernel() -> Any:
    """The kernel (``triton.jit``), made at first use."""
    global _read_scaled
    import triton
    import triton.language as tl

    @triton.jit
    def read_scaled(g_ptr, x_ptr, w_ptr, base, idx, inside, HAS_W: tl.constexpr,
                    ONE_PLUS_W: tl.constexpr):
        g = tl.load(g_ptr + base + idx, mask=inside, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + base + idx, mask=inside, other=0.0).to(tl.float32)
        wg = g
        if HAS_W:
            w = tl.load(w_ptr + idx, mask=inside, other=0.0).to(tl.float32)
            wg = g * (w + 1.0 if ONE_PLUS_W else w)
        return g, x, wg

    _read_scaled = read_scaled

    @triton.jit
    def through_rows_kernel(g_ptr, x_ptr, w_ptr, out_ptr, in_ptr, n_tokens, width, eps,
                            HAS_W: tl.constexpr, ONE_PLUS_W: tl.constexpr,
                            CENTRED: tl.constexpr, BLOCK_D: tl.constexpr):
        # LayerNorm dx = r·(wg − mean(wg) − xc·r²·mean(wg·xc)), xc = x − mean x,
        # r = 1/√(mean xc² + ε); RMSNorm the same with both means 0. Three passes over
        # the token: 0 the means (LayerNorm's) and g's rows, 1 the sums, 2 dx's rows
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        inf = float("inf")
        base = row * width
        zero = tl.zeros((), tl.float32)
        g_sq, g_hi, s_x, s_wg, s_xx, s_xwg, d_sq, d_hi = (zero,) * 8  # (the passes' sums)
        mean, r, c1, c2 = zero, zero, zero, zero  # (what the passes make for the next)
        for p in tl.static_range(3):
            for start in range(0, width, BLOCK_D):
                idx = start + offs
                inside = idx < width
                g, x, wg = _read_scaled(g_ptr, x_ptr, w_ptr, base, idx, inside, HAS_W,
                                        ONE_PLUS_W)
                if p == 0:
                    a = tl.abs(g)  # (a NaN counts as inf)
                    g_sq += tl.sum(g * g, 0)
                    g_hi = tl.maximum(g_hi, tl.max(tl.where(a == a, a, inf), 0))
                    if CENTRED:
                        s_x += tl.sum(x, 0)
                        s_wg += tl.sum(wg, 0)
                elif p == 1:
                    xc = tl.where(inside, x - mean, 0.0)
                    s_xx += tl.sum(xc * xc, 0)
                    s_xwg += tl.sum(xc * wg, 0)
                else:
                    dx = tl.where(inside, r * (wg - c1 - (x - mean) * c2), 0.0)  # (RMS: 0, 0)
                    b = tl.abs(dx)
                    d_sq += tl.sum(dx * dx, 0)
                    d_hi = tl.maximum(d_hi, tl.max(tl.where(b == b, b, inf), 0))
            if p == 0:
                mean = s_x / width
                c1 = s_wg / width
            elif p == 1:
                r = 1.0 / tl.sqrt(s_xx / width + eps)
                c2 = r * r * s_xwg / width
        tl.store(out_ptr + row, tl.sqrt(g_sq))
        tl.store(out_ptr + n_tokens + row, tl.where(g_hi == inf, float("nan"), g_hi))
        tl.store(in_ptr + row, tl.sqrt(d_sq))
        tl.store(in_ptr + n_tokens + row, tl.where(d_hi == inf, float("nan"), d_hi))

    return through_rows_kernel
