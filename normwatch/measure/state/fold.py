"""The fold of a step's staged calls into one float64 line per call, by torch's ops.

    >>> plan = fold_plan(calls, limits)       # once per distinct forward pass (cached)
    >>> lines = fold_calls(calls, plan)       # (calls, columns) float64, on their device

:func:`fold_calls` turns the rows of every staged call
(:class:`~normwatch.measure.state.rows.CallRows`) into one float64 line per call, the
device columns of :mod:`normwatch.catalog` (:data:`~normwatch.catalog.COLUMNS`), which
the accumulator (:mod:`~normwatch.measure.state.accumulator`) folds into the per-layer
state. The per-token arithmetic runs once over all calls together, not once per call: on
the CPU each tensor op costs microseconds whatever its size. A backend may fold its own
way (the native one: one C call, the same float32 arithmetic).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from normwatch.catalog import COLUMNS, SCORE_BASE, identity_row
from normwatch.measure.state.rows import CallRows, Signature, runs
from normwatch.records import Limits


@dataclass(frozen=True)
class FoldPlan:
    """The constant vectors of a fold, built once per distinct forward pass (by fill
    kernels: no host-to-device copy) and reused every step.

    Per call (length ``calls``): ``rows`` (the layer's accumulator row, int64),
    ``n_in``/``n_out`` token counts, ``width``, ``eps`` and ``key_offset`` (the key minus
    the first call's, float64). Per input token:
    ``segment`` (its call), ``inv_width`` and ``inv_sqrt_width`` (1/w and 1/sqrt(w)) and
    ``dominated_below`` (eps dominates where sqrt of the mean square or variance is below
    it). ``out_segment``: the call of each output token.
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
    identity: torch.Tensor
    """``(columns, calls)`` float64: each column's reduction identity (what a call that
    did not measure a statistic contributes)."""
    identities: tuple[torch.Tensor, ...]
    """:attr:`identity`'s rows (views made once: a fold takes the ones it needs as they are)."""
    limits: Limits
    table: torch.Tensor | None = None
    """CPU calls with float keys: the C fold's per-call constants, one line per call
    (float64: tokens, lined up, width, eps, 1/width, 1/sqrt(width), ``dominated_below``,
    key offset: ``P_...`` in the C source), else ``None``."""
    sizes: list[int] | None = None
    """With :attr:`table`: each call's row count in floats as the C fold reads it (its
    rows, then its output's where they line up, then the moments, ``n_in`` each)."""
    consts: torch.Tensor | None = None
    """Calls with float keys: one float64 line per call for a kernel's fold, on the
    calls' device (where its tokens start among the gathered rows, then as
    :attr:`table`: tokens, width, eps, 1/width, 1/sqrt(width), ``dominated_below``, key
    offset), else ``None``."""

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
    identity = per([v for v in identity_row(COLUMNS) for _ in calls], dtype=torch.float64
                   ).view(len(COLUMNS), len(calls))
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
        identity=identity, identities=identity.unbind(0),
        limits=limits,
        table=_table(sig, below) if device.type == "cpu" else None,
        sizes=[((5 if calls[0].full else 2) + 2 * s.lined_up) * s.n_in for s in sig]
        if device.type == "cpu" else None,
        consts=_consts(sig, below, device),
    )


def _consts(sig: Sequence[Signature], below: Sequence[float], device: torch.device
            ) -> torch.Tensor | None:
    """:attr:`FoldPlan.consts` (``None``: a key is a tensor, a compiled call's)."""
    if not all(isinstance(s.offset, float) for s in sig):
        return None
    starts = [0, *accumulate(s.n_in for s in sig)][:-1]
    values = [v for s, b, start in zip(sig, below, starts, strict=True)
              for v in (start, s.n_in, s.width, s.eps, 1 / s.width, 1 / math.sqrt(s.width), b,
                        s.offset)]
    table = torch.tensor(values, dtype=torch.float64) if device.type == "cpu" else \
        runs(values, [1] * len(values), torch.float64, device)  # (no host-to-device copy)
    return table.view(len(sig), 8)


def _table(sig: Sequence[Signature], below: Sequence[float]) -> torch.Tensor | None:
    """:attr:`FoldPlan.table` (``None``: a key is a tensor, a compiled call's)."""
    if not all(isinstance(s.offset, float) for s in sig):
        return None
    return torch.tensor([[s.n_in, float(s.lined_up), s.width, s.eps, 1 / s.width,
                          1 / math.sqrt(s.width), b, s.offset]
                         for s, b in zip(sig, below, strict=True)], dtype=torch.float64)


def fold_calls(calls: Sequence[CallRows], plan: FoldPlan) -> torch.Tensor:
    """Every call's contribution, as a ``(calls, columns)`` float64 matrix in
    :data:`COLUMNS` order. All calls share a device and a tier; ``plan`` comes from
    :func:`fold_plan` for the same calls.

    Value statistics cover finite tokens only: tokens holding NaN/inf count in
    ``nonfinite`` and drop out of every max, count and sum. ``output_mismatch`` is left at
    -inf; columns the sentinel tier does not measure keep their reduction identity.
    Written for few, whole-vector ops (on the CPU each op costs microseconds whatever its
    size): per-token rows are stacked and reduced per call together, and eps dominance,
    monotonic in the variance, is derived from each call's smallest one.
    """
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
    return torch.stack([cols.get(name, plan.identities[i]) for i, name in enumerate(COLUMNS)],
                       1).double()


_v, _shape = operator.attrgetter("v"), operator.attrgetter("v.shape")


def gathered(calls: Sequence[CallRows], plan: FoldPlan) -> torch.Tensor:
    """The rows of every call side by side, ``(k, tokens)`` float32, calls in order: max
    and min of the input, then (``plan.aligned``) of the output, then (full tier) sum,
    L2 norm and spread. One or two ops when the calls look alike (a transformer's norms
    all do)."""
    first = calls[0].v
    if len(calls) == 1:
        v = first.reshape(first.shape[0], -1)
    elif len(set(map(_shape, calls))) == 1:
        v = torch.stack(list(map(_v, calls)), 1).view(first.shape[0], -1)
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
        return plan.identities[COLUMNS.index("out_nonfinite")], \
            plan.identities[COLUMNS.index("out_absmax")]
    absmax = torch.cat(outs, 1).float().abs().amax(0)
    absmax = absmax.nan_to_num(-math.inf, -math.inf, -math.inf)  # -inf marks NaN/inf
    bad = plan.per_call((absmax < 0).float()[None], "sum", out=True)[0]
    return bad, plan.per_call(absmax[None], "amax", out=True)[0]


