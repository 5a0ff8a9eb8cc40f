"""One fused pass per norm call: a Triton kernel for the per-token row statistics.

    >>> rows = row_stats_triton(tokens, out_tokens)   # (tokens, 7) float32, on the device

Each program reads one token of the input (and of the output, when given) exactly once,
in chunks of ``BLOCK_D`` elements, and writes seven floats (:data:`ROW_COLUMNS`): max |x|
and the sum, sum of squares and centred sum of squares (Chan's parallel merge of per-chunk
two-pass moments: numerically stable) over the finite elements, the count of non-finite
elements, and the output's max |y| and non-finite count. The folding of those rows into
the layer's statistics is shared with the torch path
(:func:`~normwatch.measure.reductions.rows_from_fused`,
:func:`~normwatch.measure.reductions.fold_calls`).

Used automatically for CUDA tensors when Triton imports; tested on the CPU in Triton's
interpreter (``TRITON_INTERPRET=1``). :func:`row_stats_torch` is the reference.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

ROW_COLUMNS = ("absmax", "sum", "sumsq", "m2", "nonfinite", "out_absmax", "out_nonfinite")
MAX_BLOCK_D = 2048


@functools.cache
def available() -> bool:
    """Whether Triton imports (the kernel then runs on CUDA, or anywhere when interpreted)."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install
        return False
    return True


def usable() -> bool:
    """Whether the kernel can run here: Triton imports and a GPU driver is up, or Triton's
    CPU interpreter is on (``TRITON_INTERPRET=1``)."""
    interpreted = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
    return available() and (interpreted or torch.cuda.is_available())


def row_stats_torch(tokens: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: the same seven columns computed with torch, in float64."""
    x = tokens.double()
    finite = torch.isfinite(x)
    xf = torch.where(finite, x, 0.0)
    n = finite.sum(1)
    total = xf.sum(1)
    mean = total / n.clamp_min(1)
    m2 = torch.where(finite, (x - mean[:, None]) ** 2, 0.0).sum(1)
    absmax = torch.where(finite, x.abs(), -torch.inf).amax(1)
    cols = [absmax, total, (xf * xf).sum(1), m2, (~finite).sum(1).double()]
    if out is not None:
        y = out.double()
        yfinite = torch.isfinite(y)
        cols += [torch.where(yfinite, y.abs(), -torch.inf).amax(1), (~yfinite).sum(1).double()]
    else:
        cols += [torch.full_like(absmax, -torch.inf), torch.zeros_like(absmax)]
    return torch.stack(cols, 1)


def row_stats_triton(tokens: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Run the kernel on ``(tokens, elements)`` views (any strides); ``out`` must have the
    same shape as ``tokens``. Returns a ``(tokens, 7)`` float32 tensor on their device."""
    if tokens.dim() != 2:
        raise ValueError(f"'tokens' must be 2-D (tokens, elements): got shape "
                         f"{tuple(tokens.shape)}")
    if out is not None and out.shape != tokens.shape:
        raise ValueError(f"'out' must have the shape of 'tokens' {tuple(tokens.shape)}: got "
                         f"{tuple(out.shape)}")
    n_tokens, width = tokens.shape
    rows = torch.empty(n_tokens, len(ROW_COLUMNS), dtype=torch.float32, device=tokens.device)
    if n_tokens == 0:
        return rows
    import triton

    block = min(MAX_BLOCK_D, triton.next_power_of_2(max(width, 1)))
    y = out if out is not None else tokens
    _kernel()[(n_tokens,)](
        tokens, y, rows, width, tokens.stride(0), tokens.stride(1), y.stride(0), y.stride(1),
        HAS_OUT=out is not None, BLOCK_D=block,
    )
    return rows


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def row_stats_kernel(x_ptr, y_ptr, rows_ptr, width, sxt, sxd, syt, syd,
                         HAS_OUT: tl.constexpr, BLOCK_D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        inf = float("inf")
        hi = tl.full((), -inf, tl.float32)
        lo = tl.full((), inf, tl.float32)
        n = tl.zeros((), tl.float32)
        mean = tl.zeros((), tl.float32)
        m2 = tl.zeros((), tl.float32)
        sumsq = tl.zeros((), tl.float32)
        bad = tl.zeros((), tl.float32)
        for start in range(0, width, BLOCK_D):
            idx = start + offs
            inside = idx < width
            x = tl.load(x_ptr + row * sxt + idx * sxd, mask=inside, other=0.0).to(tl.float32)
            ok = inside & (x == x) & (tl.abs(x) < inf)
            bad += tl.sum((inside & ~ok).to(tl.float32), 0)
            xz = tl.where(ok, x, 0.0)
            hi = tl.maximum(hi, tl.max(tl.where(ok, x, -inf), 0))
            lo = tl.minimum(lo, tl.min(tl.where(ok, x, inf), 0))
            c_n = tl.sum(ok.to(tl.float32), 0)
            c_mean = tl.sum(xz, 0) / tl.maximum(c_n, 1.0)
            dev = tl.where(ok, x - c_mean, 0.0)
            c_m2 = tl.sum(dev * dev, 0)
            sumsq += tl.sum(xz * xz, 0)
            total = n + c_n
            delta = c_mean - mean
            mean += delta * c_n / tl.maximum(total, 1.0)
            m2 += c_m2 + delta * delta * n * c_n / tl.maximum(total, 1.0)
            n = total
        base = rows_ptr + row * 7
        tl.store(base + 0, tl.maximum(hi, -lo))
        tl.store(base + 1, mean * n)
        tl.store(base + 2, sumsq)
        tl.store(base + 3, m2)
        tl.store(base + 4, bad)
        out_hi = tl.full((), -inf, tl.float32)
        out_bad = tl.zeros((), tl.float32)
        if HAS_OUT:
            for start in range(0, width, BLOCK_D):
                idx = start + offs
                inside = idx < width
                y = tl.load(y_ptr + row * syt + idx * syd, mask=inside, other=0.0)
                y = y.to(tl.float32)
                ok = inside & (y == y) & (tl.abs(y) < inf)
                out_bad += tl.sum((inside & ~ok).to(tl.float32), 0)
                out_hi = tl.maximum(out_hi, tl.max(tl.where(ok, tl.abs(y), -inf), 0))
        tl.store(base + 5, out_hi)
        tl.store(base + 6, out_bad)

    return row_stats_kernel
