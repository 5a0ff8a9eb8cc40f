"""Per-call reductions of a norm's input and output, and their per-step fold.

Pure tensor functions, no host synchronisation: every result stays on the input's
device. A *token* is one normalized vector: the trailing dims of a layer/RMS norm,
one group of a GroupNorm, one channel of a BatchNorm, one (sample, channel) of an
InstanceNorm. All arithmetic is fp32 (or wider) whatever the input dtype.

Two stages keep the hook cheap. In the hook, :func:`reduce_call` reads the activation
with a few row reductions and keeps a few floats per token, stacked into one tensor
(:class:`CallRows`). At the flush (every step where the early warning peeks),
:func:`fold_calls` turns the rows of every call into one float64 vector per call,
the device columns of :mod:`normwatch.catalog` (:data:`~normwatch.catalog.COLUMNS`),
which :mod:`normwatch.measure.accumulator` folds into the per-layer state.
The per-token arithmetic thus runs once over all calls together, not once per call: on
the CPU each tensor op costs microseconds whatever its size. There, where the C library
is at hand, the fold is one call of it (:func:`_folded_natively`), with the same float32
arithmetic.
"""

from __future__ import annotations

import ctypes
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, cast

import torch

from normwatch.catalog import COLUMNS, SCORE_BASE, identity_row
from normwatch.measure.native import fold_rows, row_stats
from normwatch.records import Kind, Limits

_HALF = (torch.float16, torch.bfloat16)
_WIDE = (torch.float32, torch.float64)


def summed_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The ``dtype=`` for a norm or sum over a ``dtype`` tensor: fp32 for the half formats
    (their own range overflows), ``None`` (their own) for the rest."""
    return torch.float32 if dtype in _HALF else None


def token_view(x: torch.Tensor, kind: Kind, token_ndim: int = 1, groups: int = 1,
               width: int | None = None) -> torch.Tensor:
    """Reshape ``x`` to ``(tokens, elements)`` for a norm of ``kind``.

    Layer/RMS norms: ``width`` elements per token (consecutive chunks of the trailing
    data: the normalized dims, a head of a per-head norm, a group of a grouped RMSNorm)
    when it divides the input, else the trailing ``token_ndim`` dims. ``groups``: the
    GroupNorm group count.
    """
    if x.dim() == 0:
        return x.reshape(1, 1)
    if kind in ("layernorm", "rmsnorm"):
        if width and x.numel() % width == 0:
            return x.reshape(-1, width)
        nd = max(1, min(token_ndim, x.dim()))
        width = math.prod(x.shape[x.dim() - nd :])
        return x.reshape(-1, max(width, 1))
    if x.dim() == 1:
        return x.reshape(1, -1)
    if kind == "groupnorm":
        return x.reshape(x.shape[0] * groups, -1)
    if kind == "instancenorm":
        return x.reshape(x.shape[0] * x.shape[1], -1) if x.dim() >= 3 else x.reshape(x.shape[0], -1)
    # batchnorm: one token per channel, across the batch and spatial dims
    return x.transpose(0, 1).reshape(x.shape[1], -1)


HI, LO, OUT_HI, OUT_LO = 0, 1, 2, 3
"""The first rows of :attr:`CallRows.v` (of :meth:`CallRows.rows`): each input token's max
and min, then a lined-up output's."""


class Signature(NamedTuple):
    """What the fold's constant vectors depend on for one call (:meth:`CallRows.signature`)."""

    row: int
    n_in: int
    n_out: int
    width: int
    eps: float
    offset: float
    """The call's key relative to the first staged call's."""
    centred: bool
    lined_up: bool


class CallRows(NamedTuple):
    """One norm call, reduced to a few per-token values on its device (a named tuple:
    built on the hot path, where a frozen dataclass costs several times more).

    ``v`` holds them stacked, one allocation per call, ``(k, ...)`` with one element per
    token after the first dim: each token's max and min (``hi``, ``lo``: NaN where the
    token holds a NaN, ±inf where it holds ±inf; max |x| and the non-finite flag in two
    plain reductions); then, for an output whose tokens line up with the input's
    (``lined_up``), the same two of the output; then, full tier, the sum, the L2 norm
    and the *spread* (the L2 norm of the centred token for norms that subtract the mean,
    the L2 norm itself for RMS norms): what eps competes with. A call of the fused kernel
    (``fused``) keeps the kernel's ``(tokens, 7)`` rows as they came: converted once per
    fold for all calls (:func:`gathered`), so that the call itself is one launch.
    """

    row: int
    """The layer's accumulator row."""
    key: float | torch.Tensor
    """The call's position (see :data:`KEY_STRIDE`)."""
    width: int
    eps: float
    v: torch.Tensor
    n: int
    """Input tokens."""
    lined_up: bool = False
    full: bool = False
    """Whether the full statistics were measured (else the sentinel tier)."""
    fused: bool = False
    centred: bool = True
    """The norm subtracts the mean (else an RMS norm)."""
    out: torch.Tensor | None = None
    """``(2, output tokens)``: max and min of each token of an output that does not line
    up with the input (missing: ``None``)."""

    def rows(self) -> torch.Tensor:
        """The input's and (lined up) the output's rows, ``(k, tokens)`` (see ``v``)."""
        if self.fused:
            return _from_fused(self.v, self.lined_up, self.v.new_full((1,), self.centred))
        return self.v.reshape(self.v.shape[0], -1)

    @property
    def hi(self) -> torch.Tensor:
        return self.rows()[HI]

    @property
    def lo(self) -> torch.Tensor:
        return self.rows()[LO]

    def outs(self) -> torch.Tensor | None:
        """``(2, output tokens)``: each output token's max and min (``None``: no output)."""
        return self.rows()[OUT_HI:OUT_LO + 1] if self.lined_up else self.out

    def signature(self, key0: float | torch.Tensor) -> Signature:
        """What the fold's constant vectors depend on (the same every step for the same
        forward pass): row, token counts, width, eps, the key relative to ``key0``
        (staged calls: float keys), whether the norm centres and whether the output lines
        up."""
        n_out = self.n if self.lined_up else 0 if self.out is None else self.out.shape[1]
        offset = cast(float, self.key - key0)
        return Signature(self.row, self.n, n_out, self.width, self.eps, offset, self.centred,
                         self.lined_up)


# The most elements a call's temporaries may hold (1 MiB of fp32): a few floats per token
# for activations of 64k tokens, and never an fp32 copy of a whole activation.
CHUNK_ELEMENTS = 1 << 18


def reduce_call(tokens: torch.Tensor, out: torch.Tensor | None, kind: Kind, eps: float,
                full: bool, row: int, key: float | torch.Tensor, native: bool = False) -> CallRows:
    """Read one call: ``tokens`` is the input with one token per element of its leading
    dims (the last dim: see :func:`token_view`), never empty; ``out`` the output, lined
    up when its leading dims are the input's, else as ``(tokens, elements)`` (any count),
    or ``None``. Plain row reductions stacked into one allocation: no temporary for the
    sentinel tier, nor for the full tier of an fp32 RMS norm; otherwise temporaries of
    at most :data:`CHUNK_ELEMENTS` (see :func:`_moments`). ``native``: either tier reads
    the CPU tensors it covers in one call of the C kernel instead, no temporary
    (:func:`~normwatch.measure.native.row_stats`; the full tier's moments summed in
    float64)."""
    x = tokens
    lined_up = out is not None and out.shape[:-1] == x.shape[:-1]
    centred = kind != "rmsnorm"
    v = row_stats(x, out if lined_up else None,
                  ("centred" if centred else "rms") if full else None) if native else None
    if v is None:
        if full and x.dim() != 2 and (centred or x.dtype not in _WIDE):  # chunked: rows
            x = x.reshape(-1, x.shape[-1])
            out = out.reshape(-1, out.shape[-1]) if lined_up else out  # type: ignore[union-attr]
        rows = [x.amax(-1), x.amin(-1)]
        if lined_up:
            rows += [out.amax(-1), out.amin(-1)]  # type: ignore[union-attr]
        if full:
            rows += _moments(x, centred)
        v = torch.stack(rows)
    spare = out_rows(out) if out is not None and not lined_up and out.numel() else None
    return CallRows(row, key, x.shape[-1], eps, v, x.shape[:-1].numel(), lined_up, full,
                    centred=centred, out=spare)


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


def fused_call(rows: torch.Tensor, kind: Kind, eps: float, width: int, has_out: bool,
               row: int, key: float) -> CallRows:
    """The :class:`CallRows` of the fused kernel's ``(tokens, 7)`` rows
    (:mod:`normwatch.measure.triton_kernel`): kept as they are until the fold."""
    return CallRows(row, key, width, eps, rows, rows.shape[0], has_out, True, True,
                    kind != "rmsnorm")


def _from_fused(raw: torch.Tensor, has_out: bool, centred: torch.Tensor) -> torch.Tensor:
    """The rows of :class:`CallRows` (``(k, tokens)``, full tier) from the fused kernel's
    ``(tokens, 7)`` rows. The kernel's moments skip non-finite elements; here, as on the
    torch path, a token holding one gets NaN everywhere. Max |x| stands for both ``hi``
    and ``lo`` (``max(|hi|, |lo|)`` is then max |x|). ``centred``: per token (or one for
    all), whether the spread is the centred one."""
    bad = raw[:, 4:5] > 0
    moments = torch.where(bad, math.nan, raw[:, :4]).T  # absmax, sum, sumsq, m2
    roots = moments[2:].sqrt()
    spread = torch.where(centred > 0, roots[1], roots[0])
    rows = [moments[0], moments[0]]
    if has_out:
        out_absmax = torch.where(raw[:, 6] > 0, math.nan, raw[:, 5])
        rows += [out_absmax, out_absmax]
    return torch.stack([*rows, moments[1], roots[0], spread])


@dataclass(frozen=True)
class FoldPlan:
    """The constant vectors of a fold, built once per distinct forward pass (by fill
    kernels: no host-to-device copy) and reused every step.

    Per call (length ``calls``): ``rows`` (the layer's accumulator row, int64),
    ``n_in``/``n_out`` token counts, ``width``, ``eps`` and ``key_offset`` (the key minus
    the first call's, float64). Per input token:
    ``segment`` (its call), ``inv_width`` and ``inv_sqrt_width`` (1/w and 1/sqrt(w)) and
    ``dominated_below`` (eps dominates where sqrt of the mean square or variance is below
    it) and ``centred`` (1 where the norm subtracts the mean). ``out_segment``: the call
    of each output token.
    """

    n_calls: int
    uniform: int
    """Tokens per call when every call has the same count (per-call reductions are then
    plain reductions over a view), else 0."""
    aligned: bool
    """Whether every call's output lines up with its input (:attr:`CallRows.lined_up`)."""
    out_uniform: int
    rows: torch.Tensor
    n_in: torch.Tensor
    n_out: torch.Tensor
    width: torch.Tensor
    eps: torch.Tensor
    key_offset: torch.Tensor
    segment: torch.Tensor
    out_segment: torch.Tensor
    inv_width: torch.Tensor
    inv_sqrt_width: torch.Tensor
    dominated_below: torch.Tensor
    centred: torch.Tensor
    identity: torch.Tensor
    """``(columns, calls)`` float64: each column's reduction identity (what a call that
    did not measure a statistic contributes)."""
    limits: Limits
    table: torch.Tensor | None = None
    """CPU calls with float keys: the C fold's per-call constants, one line per call
    (float64: tokens, lined up, width, eps, 1/width, 1/sqrt(width), ``dominated_below``,
    key offset: ``P_...`` in the C source), else ``None``."""
    sizes: list[int] | None = None
    """With :attr:`table`: each call's row count in floats as the C fold reads it (its
    rows, then its output's where they line up, then the moments, ``n_in`` each)."""

    def per_call(self, x: torch.Tensor, how: str, out: bool = False) -> torch.Tensor:
        """Reduce the ``(k, tokens)`` rows of ``x`` per call (``how``: sum, amax or amin):
        a ``(k, calls)`` tensor. ``out``: ``x`` holds output tokens."""
        uniform = self.out_uniform if out else self.uniform
        if uniform:
            v = x.reshape(x.shape[0], self.n_calls, uniform)
            return v.sum(2) if how == "sum" else v.amax(2) if how == "amax" else v.amin(2)
        segment = self.out_segment if out else self.segment
        if how == "sum":
            return x.new_zeros(x.shape[0], self.n_calls).index_add_(1, segment, x)
        fill = -math.inf if how == "amax" else math.inf
        index = segment[None].expand_as(x)
        return x.new_full((x.shape[0], self.n_calls), fill).scatter_reduce_(1, index, x, how)


def runs(values: Sequence[float], counts: Sequence[int], dtype: torch.dtype,
         device: torch.device) -> torch.Tensor:
    """``values[i]`` repeated ``counts[i]`` times, made on ``device`` by fill kernels (a
    plan's constant vectors: no host-to-device copy)."""
    return torch.cat([torch.full((n,), v, dtype=dtype, device=device)
                      for v, n in zip(values, counts, strict=True)] or
                     [torch.empty(0, dtype=dtype, device=device)])


def fold_plan(calls: Sequence[CallRows], limits: Limits) -> FoldPlan:
    """The constant vectors :func:`fold_calls` needs for ``calls`` (see :class:`FoldPlan`)."""
    device = calls[0].v.device

    def per(values: Sequence[float], counts: Sequence[int] | None = None,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return runs(values, counts or [1] * len(values), dtype, device)

    sig = [c.signature(calls[0].key) for c in calls]
    n_in, n_out = [s.n_in for s in sig], [s.n_out for s in sig]
    width = [float(s.width) for s in sig]
    tol = limits.eps_tol
    # eps/(s + eps) > tol  <=>  sqrt(s) < sqrt(eps (1 - tol) / tol); eps = 0: sqrt(s) == 0
    # counts, i.e. sqrt(s) below the smallest float32 subnormal
    below = [math.sqrt(s.eps * (1 - tol) / tol) if s.eps > 0 else 2.0**-149 for s in sig]
    index = list(range(len(calls)))
    return FoldPlan(
        n_calls=len(calls),
        uniform=n_in[0] if len(set(n_in)) == 1 else 0,
        aligned=all(s.lined_up for s in sig),
        out_uniform=n_out[0] if len(set(n_out)) == 1 and n_out[0] else 0,
        rows=per([s.row for s in sig], dtype=torch.int64),
        n_in=per(n_in), n_out=per(n_out), width=per(width), eps=per([s.eps for s in sig]),
        key_offset=per([s.offset for s in sig], dtype=torch.float64),
        segment=per(index, n_in, torch.int64),
        out_segment=per(index, n_out, torch.int64) if sum(n_out) else
        torch.empty(0, dtype=torch.int64, device=device),
        inv_width=per([1 / w for w in width], n_in),
        inv_sqrt_width=per([1 / math.sqrt(w) for w in width], n_in),
        dominated_below=per(below, n_in),
        centred=per([float(s.centred) for s in sig], n_in),
        identity=per([v for v in identity_row(COLUMNS) for _ in calls], dtype=torch.float64)
        .view(len(COLUMNS), len(calls)),
        limits=limits,
        table=_table(sig, below) if device.type == "cpu" else None,
        sizes=[((5 if calls[0].full else 2) + 2 * s.lined_up) * s.n_in for s in sig]
        if device.type == "cpu" else None,
    )


def _table(sig: Sequence[Signature], below: Sequence[float]) -> torch.Tensor | None:
    """:attr:`FoldPlan.table` (``None``: a key is a tensor, a compiled call's)."""
    if not all(isinstance(s.offset, float) for s in sig):
        return None
    return torch.tensor([[s.n_in, float(s.lined_up), s.width, s.eps, 1 / s.width,
                          1 / math.sqrt(s.width), b, s.offset]
                         for s, b in zip(sig, below, strict=True)], dtype=torch.float64)


def fold_calls(calls: Sequence[CallRows], plan: FoldPlan, native: bool = False) -> torch.Tensor:
    """Every call's contribution, as a ``(calls, columns)`` float64 matrix in
    :data:`COLUMNS` order. All calls share a device and a tier; ``plan`` comes from
    :func:`fold_plan` for the same calls. ``native``: in one call of the C kernel where
    it covers the calls (:func:`_folded_natively`).

    Value statistics cover finite tokens only: tokens holding NaN/inf count in
    ``nonfinite`` and drop out of every max, count and sum. ``output_mismatch`` is left at
    -inf; columns the sentinel tier does not measure keep their reduction identity.
    Written for few, whole-vector ops (on the CPU each op costs microseconds whatever its
    size): per-token rows are stacked and reduced per call together, and eps dominance,
    monotonic in the variance, is derived from each call's smallest one.
    """
    folded = _folded_natively(calls, plan) if native else None
    if folded is not None:
        return folded
    inf, t = math.inf, plan.limits
    v = gathered(calls, plan)
    # max |x| per token, NaN/inf exactly on tokens holding NaN/inf: (inputs[, outputs])
    g = 2 if plan.aligned else 1
    absmax = v[:2 * g].view(g, 2, -1).abs().amax(1)
    peaks = [absmax.nan_to_num(-inf, -inf, -inf)]  # max |x| >= 0: -inf marks NaN/inf
    summed = [peaks[0] >= 0, peaks[0][:1] > t.fp16_limit]
    if calls[0].full:
        f = v[2 * g:].float()  # sum, L2 norm, spread
        roots = f[1:] * plan.inv_sqrt_width  # RMS and sqrt(mean square or variance)
        common = (f[0] * plan.inv_width).abs() / roots[0].clamp_min(1e-30)  # |mean| / RMS
        peaks.append(torch.stack([roots[0], common]).nan_to_num(-inf, -inf, -inf))
        lows = roots.nan_to_num(inf, inf, inf)
        summed += [peaks[1][1:] > t.common_mode_tol, lows[1:] < plan.dominated_below,
                   roots[:1].nan_to_num(0.0, 0.0, 0.0)]
    # rows: finite (in[, out]), fp16 overflow[, common mode, eps dominated, RMS sum]
    sums = plan.per_call(torch.cat(summed).float(), "sum")
    # rows: max |x| (in[, out])[, RMS, common mode]
    maxes = plan.per_call(torch.cat(peaks), "amax")
    nonfinite = plan.n_in - sums[0]
    if plan.aligned:
        out_bad, out_absmax = plan.n_out - sums[1], maxes[1]
    else:
        out_bad, out_absmax = _outputs(calls, plan)
    cols = dict(calls=torch.ones_like(plan.n_in), tokens=plan.n_in, finite_tokens=sums[0],
                fp16_overflow_tokens=sums[g], nonfinite=nonfinite, out_nonfinite=out_bad,
                absmax=maxes[0], out_absmax=out_absmax)
    if calls[0].full:
        rms_max = maxes[g].double()
        rms_min, root_min = plan.per_call(lows, "amin")
        ratio = (plan.eps / (root_min.square() + plan.eps)).nan_to_num(1.0)  # eps = s = 0: 1
        cols.update(
            stats_tokens=sums[0], common_mode_tokens=sums[g + 1],
            eps_dominated_tokens=sums[g + 2], rms_sum=sums[g + 3], rms_max=rms_max,
            rms_min=rms_min, common_mode_max=maxes[g + 1],
            sumsq_max=rms_max * rms_max.abs() * plan.width,
            eps_dominance=torch.where(sums[0] > 0, ratio, -inf),
        )
    # events: a non-finite token arrived in the input; or the output has one, the input none
    score = (SCORE_BASE - calls[0].key) - plan.key_offset
    cols["first_arrived_score"] = score * (nonfinite > 0)
    cols["first_born_score"] = score * ((out_bad > 0) & (nonfinite == 0))
    return torch.stack([cols.get(name, plan.identity[i]) for i, name in enumerate(COLUMNS)],
                       1).double()


_FOLDED = ("calls", "tokens", "finite_tokens", "fp16_overflow_tokens", "nonfinite",
           "out_nonfinite", "absmax", "out_absmax", "first_arrived_score", "first_born_score",
           "stats_tokens", "common_mode_tokens", "eps_dominated_tokens", "rms_sum", "rms_max",
           "rms_min", "common_mode_max", "sumsq_max", "eps_dominance")
"""The columns the C fold writes, in its order (``F_...`` in the C source)."""
_FOLDED_AT = (ctypes.c_int64 * len(_FOLDED))(*(COLUMNS.index(name) for name in _FOLDED))


def _folded_natively(calls: Sequence[CallRows], plan: FoldPlan) -> torch.Tensor | None:
    """:func:`fold_calls` in one call of the C kernel (:func:`~normwatch.measure.native.
    fold_rows`: a few dozen torch ops over every staged token cost ~1 ms on the CPU, the
    kernel a few µs), for CPU calls whose rows are float32 and contiguous, with float keys
    and no output of another shape; else ``None``. The same values as torch's ops (the
    same float32 arithmetic), but ``rms_sum``: summed in float64 there."""
    if plan.table is None or calls[0].fused:
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
_FLOAT32, _NONE = {torch.float32}, {None}


def gathered(calls: Sequence[CallRows], plan: FoldPlan) -> torch.Tensor:
    """The rows of every call side by side, ``(k, tokens)`` float32, calls in order: max
    and min of the input, then (``plan.aligned``) of the output, then (full tier) sum,
    L2 norm and spread. One or two ops when the calls look alike (a transformer's norms
    all do)."""
    if calls[0].fused:
        raw = calls[0].v if len(calls) == 1 else torch.cat([c.v for c in calls])
        return _from_fused(raw, plan.aligned, plan.centred)
    first = calls[0].v
    if len(calls) == 1:
        v = first.reshape(first.shape[0], -1)
    elif all(c.v.shape == first.shape for c in calls):
        v = torch.stack([c.v for c in calls], 1).view(first.shape[0], -1)
    elif plan.aligned or all(not c.lined_up for c in calls):
        v = torch.cat([c.v.reshape(c.v.shape[0], -1) for c in calls], 1)
    else:  # some outputs line up, some do not: the inputs' rows only (no output rows)
        v = torch.cat([torch.cat([r[:2], r[4:]]) if c.lined_up else r
                       for c, r in ((c, c.rows()) for c in calls)], 1)
    return v.float()


def _outputs(calls: Sequence[CallRows], plan: FoldPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Per call: output tokens holding NaN/inf and max |y| over the finite ones, for
    outputs that do not all line up with the inputs (missing or wrong-shaped)."""
    outs = [o for o in (c.outs() for c in calls) if o is not None]
    if not outs:
        return plan.identity[COLUMNS.index("out_nonfinite")], \
            plan.identity[COLUMNS.index("out_absmax")]
    absmax = torch.cat(outs, 1).float().abs().amax(0)
    absmax = absmax.nan_to_num(-math.inf, -math.inf, -math.inf)  # -inf marks NaN/inf
    bad = plan.per_call((absmax < 0).float()[None], "sum", out=True)[0]
    return bad, plan.per_call(absmax[None], "amax", out=True)[0]


def carried_eps(y: torch.Tensor) -> torch.Tensor:
    """The precision ``y`` carries (0-d float64, on its device): the eps of bf16 if every
    finite value is exact in bf16, else of fp16 if exact there, else of ``y``'s dtype. An
    fp32 output whose last rounding happened in bf16 carries bf16's digits."""
    own = torch.finfo(y.dtype).eps
    if y.dtype == torch.float64:  # not read from the bits: said as it is
        return torch.full((), own, dtype=torch.float64, device=y.device)
    yf = y.float()
    skip = ~torch.isfinite(yf)
    # from the bits, not by a round trip through the narrow dtype (a compiler may drop it)
    bits = yf.view(torch.int32)
    bf16 = (((bits & 0xFFFF) == 0) | skip).all()  # bf16 keeps the top 16 bits
    f16 = ((((bits & 0x1FFF) == 0) & (yf.abs() <= 65504.0)) | skip).all()  # 10-bit mantissa
    carried = torch.where(bf16, 2.0**-7, torch.where(f16, 2.0**-10, own))
    return carried.to(torch.float64)


CHECKED = 16
"""An output check reads ``3 * CHECKED`` rows of a call (:func:`checked_rows`)."""


def checked_rows(hi: torch.Tensor, lo: torch.Tensor, per_row: int) -> torch.Tensor:
    """The rows an output check reads (int64, ``3 * CHECKED``, maybe repeated), from each
    token's max and min (``per_row`` tokens per row): the :data:`CHECKED` tokens reaching
    the largest |x| (where a norm's own arithmetic overflows first), the ones of smallest
    range (where eps matters: a misplaced eps shows there) and ones spread evenly (a wrong
    dimension or dtype shows everywhere). Any token count, no branch on it (compiled
    shapes may be symbolic): short calls pad and repeat."""
    n = hi.shape[0]
    hi, lo = hi.float(), lo.float()
    pad = hi.new_full((CHECKED,), -math.inf)
    big = torch.maximum(hi, -lo).nan_to_num(-1.0, -1.0, -1.0)  # non-finite: last
    narrow = (lo - hi).nan_to_num(-math.inf, -math.inf, -math.inf)
    spread = torch.arange(CHECKED, device=hi.device) * n // CHECKED
    picked = torch.cat([torch.cat([big, pad]).topk(CHECKED).indices,
                        torch.cat([narrow, pad]).topk(CHECKED).indices, spread])
    return picked.clamp_max(n - 1) // per_row


def mismatch(out_tokens: torch.Tensor, ref_tokens: torch.Tensor) -> torch.Tensor:
    """Largest per-token relative L2 error of ``out`` against ``ref``; tokens where either
    is non-finite are skipped (non-finite outputs are counted elsewhere)."""
    y = out_tokens.float()
    ref = ref_tokens.float()
    err = torch.linalg.vector_norm(y - ref, dim=1)
    scale = torch.linalg.vector_norm(ref, dim=1).clamp_min(1e-6 * math.sqrt(ref.shape[1]))
    rel = err / scale
    worst: torch.Tensor = rel.nan_to_num(-math.inf, -math.inf, -math.inf).amax()
    return worst
