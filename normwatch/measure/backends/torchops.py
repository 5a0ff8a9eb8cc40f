"""The torch backend: every statistic by torch's own ops, on any device (the universal
fallback the other backends use for what their kernels do not cover).

    >>> call = TORCH.call_rows(layer, x, y, key, full=True)
    >>> norms, lo, hi = TORCH.grad_rows(layer, site, g, None)

A call is read with a few row reductions stacked into one allocation
(:func:`reduce_call`), a gradient with two (:func:`token_rows`); the folds are
:mod:`~normwatch.measure.state.fold`'s and :mod:`~normwatch.measure.state.grad_fold`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from normwatch.measure.state.accumulator import MAX_END, N_SUM
from normwatch.measure.state.backend import Launcher, Sample
from normwatch.measure.state.fold import FoldPlan, fold_calls
from normwatch.measure.state.grad_fold import GradPlan, fold_grads
from normwatch.measure.state.rows import (
    _WIDE,
    WEIGHT,
    CallRows,
    GradRows,
    LayerRows,
    summed_dtype,
)
from normwatch.records import Kind

# The most elements a call's temporaries may hold (1 MiB of fp32): a few floats per token
# for activations of 64k tokens, and never an fp32 copy of a whole activation.
CHUNK_ELEMENTS = 1 << 18


def reduce_call(tokens: torch.Tensor, out: torch.Tensor | None, kind: Kind, eps: float,
                full: bool, row: int, key: float | torch.Tensor,
                v: torch.Tensor | None = None) -> CallRows:
    """Read one call: ``tokens`` is the input with one token per element of its leading
    dims (the last dim: see :func:`token_view`), never empty; ``out`` the output, lined
    up when its leading dims are the input's, else as ``(tokens, elements)`` (any count),
    or ``None``. Plain row reductions stacked into one allocation: no temporary for the
    sentinel tier, nor for the full tier of an fp32 RMS norm; otherwise temporaries of
    at most :data:`CHUNK_ELEMENTS` (see :func:`_moments`). ``v``: the input's and a
    lined-up output's rows where a kernel read them already."""
    lined_up = lines_up(tokens, out)
    centred = kind != "rmsnorm"
    if v is None:
        v = rows_of(tokens, out if lined_up else None, centred, full)
    spare = out_rows(out) if out is not None and not lined_up and out.numel() else None
    return CallRows(row, key, tokens.shape[-1], eps, v, tokens.shape[:-1].numel(), lined_up,
                    full, centred, spare)


def rows_of(x: torch.Tensor, out: torch.Tensor | None, centred: bool, full: bool
            ) -> torch.Tensor:
    """The rows of :class:`~normwatch.measure.state.rows.CallRows` of input tokens ``x``
    and lined-up output tokens ``out`` (or ``None``), by torch's row reductions."""
    if full and x.dim() != 2 and (centred or x.dtype not in _WIDE):  # chunked: rows
        x = x.reshape(-1, x.shape[-1])
        out = None if out is None else out.reshape(-1, out.shape[-1])
    rows = [x.amax(-1), x.amin(-1)]
    if out is not None:
        rows += [out.amax(-1), out.amin(-1)]
    if full:
        rows += _moments(x, centred)
    return torch.stack(rows)


def lines_up(x: torch.Tensor, out: torch.Tensor | None) -> bool:
    """Whether ``out``'s tokens line up with ``x``'s (the same leading dims)."""
    return out is not None and out.shape[:-1] == x.shape[:-1]


def out_rows(out: torch.Tensor) -> torch.Tensor:
    """:attr:`CallRows.out` of an output that does not line up with its input, given as
    ``(tokens, elements)``: each token's max and min."""
    return torch.stack([out.amax(1), out.amin(1)])


def _moments(x: torch.Tensor, centred: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token sum, L2 norm and *spread* (the L2 norm of the centred token if
    ``centred``, else the L2 norm), accumulated in fp32 or wider.

    Two-pass centring is exact even at |mean|/std = 1e3 (E[x²] - E[x]² is not). On the
    CPU a reduction with ``dtype=float32`` over a bf16/fp16 tensor materialises an fp32
    copy, and centring needs one: both are done on chunks of at most
    :data:`CHUNK_ELEMENTS` elements.
    """
    wide = x.dtype in _WIDE
    if wide and not centred:  # no temporary at all (any leading dims)
        norm = torch.linalg.vector_norm(x, dim=-1)
        return x.sum(-1), norm, norm
    width = x.shape[1]
    step = max(1, CHUNK_ELEMENTS // width)
    parts = []
    for start in range(0, x.shape[0], step):
        chunk = x[start : start + step]
        chunk = chunk if wide else chunk.float()
        total = chunk.sum(1)
        norm = torch.linalg.vector_norm(chunk, dim=1)
        spread = torch.linalg.vector_norm(chunk - (total / width)[:, None], dim=1) \
            if centred else norm
        parts.append((total, norm, spread))
    if len(parts) == 1:
        return parts[0]
    total, norm, spread = (torch.cat(p) for p in zip(*parts, strict=True))
    return total, norm, spread


def token_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A gradient ``t`` (the last dim one token) as each token's L2 norm (float32, NaN/inf
    on the tokens holding NaN/inf, or whose sum of squares overflows float32) and the
    whole gradient's min and max (0-d): two reductions, no temporary the size of the
    gradient (the per-token max |g| would take two more)."""
    lo, hi = torch.aminmax(t)
    return torch.linalg.vector_norm(t, dim=-1, dtype=summed_dtype(t.dtype)), lo, hi


class TorchBackend:
    """Every statistic by torch's ops (see the module docstring)."""

    name = "torch"

    def launcher(self) -> Launcher | None:
        return None

    def call_rows(self, layer: LayerRows, x: torch.Tensor, out: torch.Tensor | None,
                  key: float | torch.Tensor, full: bool) -> CallRows:
        tokens, out_tokens = layer.token_pair(x, out)
        return reduce_call(tokens, out_tokens, layer.kind, layer.eps, full, layer.row, key)

    def grad_rows(self, layer: LayerRows, site: int, g: torch.Tensor,
                  part: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        if site == WEIGHT:
            return torch.linalg.vector_norm(g, dtype=summed_dtype(g.dtype)), None, None
        return token_rows(g if part is None else g + part)

    def covers_through(self, layer: LayerRows, x: torch.Tensor, weight: object) -> bool:
        return False

    def through_rows(self, layer: LayerRows, g: torch.Tensor, x: torch.Tensor,
                     weight: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None

    def fold(self, calls: Sequence[CallRows], plan: FoldPlan) -> torch.Tensor:
        return fold_calls(calls, plan)

    def accumulate(self, lines: torch.Tensor, rows: torch.Tensor, block: torch.Tensor
                   ) -> None:
        block[:, :N_SUM].index_add_(0, rows, lines[:, :N_SUM].to(block.dtype))
        # amax/amin of scatter_reduce propagate NaN: NaN never beats a value
        inf = math.inf
        peaks = lines[:, N_SUM:MAX_END].nan_to_num(-inf, inf, -inf).to(block.dtype)
        block[:, N_SUM:MAX_END].scatter_reduce_(
            0, rows[:, None].expand_as(peaks), peaks, "amax")
        lows = lines[:, MAX_END:].nan_to_num(inf, inf, -inf).to(block.dtype)
        block[:, MAX_END:].scatter_reduce_(0, rows[:, None].expand_as(lows), lows, "amin")

    def fold_grads(self, block: torch.Tensor, staged: Sequence[GradRows], plan: GradPlan
                   ) -> None:
        fold_grads(block, staged, plan)

    def sample(self, samples: list[torch.Tensor], scales: list[float]) -> Sample | None:
        return None

    def sampler(self, params: list[torch.Tensor], packs: Sequence[tuple[list[int], Sample]]
                ) -> object | None:
        return None

    def check(self, rows: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
              ) -> torch.Tensor | None:
        return None


TORCH = TorchBackend()
