"""Per-call statistics of a norm's input and output: the functional kernel.

Pure tensor functions, no host synchronisation: every result stays on the input's
device. A *token* is one normalized vector: the trailing dims of a layer/RMS norm,
one group of a GroupNorm, one channel of a BatchNorm, one (sample, channel) of an
InstanceNorm. All arithmetic is fp32 (or wider) whatever the input dtype.

The statistics of one call come back as one small float64 vector whose columns are
declared once, by reduction (:data:`SUM_COLUMNS`, :data:`MAX_COLUMNS`,
:data:`MIN_COLUMNS`); :mod:`normwatch.accumulator` folds it into the per-layer state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from normwatch.discovery import Kind

# Calls and tokens are counted on the host; everything else is one float64 vector per
# call, laid out as SUM_COLUMNS + MAX_COLUMNS + MIN_COLUMNS.
SUM_COLUMNS = (
    "finite_tokens", "stats_tokens", "fp16_overflow_tokens", "rms_sum", "eps_dominated_tokens",
    "common_mode_tokens", "nonfinite", "out_nonfinite",
)  # fmt: skip
MAX_COLUMNS = (
    "absmax", "sumsq_max", "rms_max", "eps_dominance", "common_mode_max",
    "out_absmax", "output_mismatch", "first_arrived_score", "first_born_score",
)  # fmt: skip
MIN_COLUMNS = ("rms_min",)
COLUMNS = SUM_COLUMNS + MAX_COLUMNS + MIN_COLUMNS

# A forward call's position is key = step * KEY_STRIDE + call index within the step. The
# first event of an interval has the smallest key, i.e. the largest score SCORE_BASE - key,
# so it folds into a max column (0 = no event). Exact in float64.
KEY_STRIDE = 1 << 20
SCORE_BASE = float(1 << 52)


@dataclass(frozen=True)
class Thresholds:
    """The constants the kernel compares against (from the watch's config)."""

    fp16_limit: float = 256.0
    eps_tol: float = 0.01
    common_mode_tol: float = 0.9


def token_view(x: torch.Tensor, kind: Kind, token_ndim: int = 1, groups: int = 1) -> torch.Tensor:
    """Reshape ``x`` to ``(tokens, elements)`` for a norm of ``kind``.

    ``token_ndim`` is the number of trailing normalized dims (layer/RMS norms);
    ``groups`` the GroupNorm group count.
    """
    if x.dim() == 0:
        return x.reshape(1, 1)
    if kind in ("layernorm", "rmsnorm"):
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


def threshold_row(thresholds: Thresholds, device: torch.device) -> torch.Tensor:
    """Per-column thresholds for the per-token matrix of :func:`call_stats` (absmax, sumsq,
    rms, eps ratio, common mode): a token counts where its value exceeds the threshold;
    +inf counts nothing."""
    row = torch.full((5,), math.inf, dtype=torch.float32, device=device)
    row[0] = thresholds.fp16_limit
    row[3] = thresholds.eps_tol
    row[4] = thresholds.common_mode_tol
    return row


def call_stats(
    tokens: torch.Tensor,
    out: torch.Tensor | None,
    kind: Kind,
    eps: float,
    thresholds: torch.Tensor,
    key: float,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Everything one norm call contributes, as a float64 vector in :data:`COLUMNS` order.

    ``tokens`` is the input as ``(tokens, elements)`` (see :func:`token_view`), never
    empty; ``out`` the layer's output (any shape) or ``None``; ``thresholds`` from
    :func:`threshold_row`; ``key`` the call's position (see :data:`KEY_STRIDE`). Value
    statistics cover finite tokens only; ``output_mismatch`` is left at -inf.

    This is the full tier; :func:`sentinel_stats` is the cheap one. ``rows`` are
    precomputed per-token rows from the fused kernel (:mod:`normwatch.triton_stats`); then
    ``tokens`` is only read for its width.
    """
    f32, inf = torch.float32, math.inf
    width = tokens.shape[1]
    if rows is not None:  # the fused kernel already read every element once
        absmax, total, sumsq, m2 = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3]
        ok = (rows[:, 4] == 0) & torch.isfinite(sumsq)
        nonfinite, out_nonfinite = rows[:, 4].sum(), rows[:, 6].sum()
        out_absmax = rows[:, 5].amax() if out is not None else rows.new_full((), -inf)
        mean = total / width
        s = sumsq / width if kind == "rmsnorm" else m2 / width
    else:
        x = tokens
        # Reductions straight from the input dtype, accumulating in fp32: no fp32 copy of
        # the activation and no full-size temporary (the CPU pays dearly for those).
        absmax = torch.maximum(x.amax(1), x.amin(1).neg()).to(f32)
        norm = torch.linalg.vector_norm(x, dim=1, dtype=f32)
        mean = x.sum(1, dtype=f32) / width
        sumsq = norm * norm
        if kind == "rmsnorm":
            s = sumsq / width
        else:  # two-pass variance: exact even at |mean|/std = 1e3 (E[x²] - E[x]² is not)
            s = torch.linalg.vector_norm(x.to(f32) - mean[:, None], dim=1).square() / width
        ok = torch.isfinite(absmax + sumsq)
        nonfinite = count_nonfinite(x)
        if out is not None and out.numel():
            out_lo, out_hi = torch.aminmax(out)  # one pass for both
            out_absmax = torch.maximum(out_hi, out_lo.neg()).to(f32)
            out_nonfinite = count_nonfinite(out)
        else:
            out_nonfinite = nonfinite.new_zeros(())
            out_absmax = nonfinite.new_full((), -inf)
    rms = (sumsq / width).sqrt()
    ratio = eps / (s + eps) if eps > 0 else (s == 0).to(f32)  # eps = 0, s = 0: 0/0 -> 1
    common = mean.abs() / rms.clamp_min(1e-30)  # all-zero token: 0, no common mode
    # Tokens holding NaN/inf drop out of every max, count and sum.
    per = torch.where(ok[:, None], torch.stack([absmax, sumsq, rms, ratio, common], 1), -inf)
    counts = (per > thresholds).sum(0, dtype=f32)  # overflow, -, -, dominated, common
    finite = ok.sum(dtype=f32)
    sums = torch.stack([finite, finite, counts[0], per[:, 2].clamp_min(0).sum(), counts[3],
                        counts[4], nonfinite.to(f32), out_nonfinite.to(f32)])
    maxes = torch.stack([out_absmax.to(f32), out_absmax.new_full((), -inf, dtype=f32)])
    score = SCORE_BASE - key
    events = torch.stack([(nonfinite > 0).double(), (out_nonfinite > nonfinite * 1e30).double()])
    low = torch.where(ok, rms, inf).amin(0, keepdim=True).double()
    return torch.cat([torch.cat([sums, per.amax(0), maxes]).double(), events * score, low])


def sentinel_template(device: torch.device) -> tuple[torch.Tensor, ...]:
    """Constant pieces of the sentinel vector, made on ``device`` by fill kernels (no
    host-to-device copy), once per device: runs of 0, -inf and +inf in column order."""
    f64 = torch.float64

    def run(n: int, value: float) -> torch.Tensor:
        return torch.full((n,), value, dtype=f64, device=device)

    # finite | stats 0 | overflow | rms_sum, eps_dom, common 0 | nonfinite, out_nonfinite |
    # absmax | 6 x -inf | arrived, born | rms_min +inf
    return run(1, 0.0), run(3, 0.0), run(6, -math.inf), run(1, math.inf)


def sentinel_stats(
    tokens: torch.Tensor,
    out: torch.Tensor | None,
    limit: float,
    template: tuple[torch.Tensor, ...],
    key: float,
) -> torch.Tensor:
    """The cheap tier, as a :data:`COLUMNS` vector: one ``aminmax`` pass over the input and
    one over the output. It measures max |x| and whether any value is non-finite; per-token
    counts (fp16-limit tokens) come from the full tier. A call holding NaN/inf counts as
    one non-finite value (a lower bound) and contributes no finite tokens."""
    f64, inf = torch.float64, math.inf
    lo, hi = torch.aminmax(tokens)
    peak = torch.maximum(hi, lo.neg()).to(f64).reshape(1)
    finite = torch.isfinite(peak)
    bad = (~finite).to(f64)
    if out is not None and out.numel():
        out_lo, out_hi = torch.aminmax(out)
        out_peak = torch.maximum(out_hi, out_lo.neg()).to(f64).reshape(1)
        out_bad = (~torch.isfinite(out_peak)).to(f64)
    else:
        out_peak, out_bad = peak.new_full((1,), -inf), bad * 0
    n_finite = finite.to(f64) * float(tokens.shape[0])
    zero1, zero3, low6, high1 = template
    events = torch.cat([bad, out_bad * (1 - bad)]) * (SCORE_BASE - key)
    return torch.cat([n_finite, zero1, zero1, zero3, bad, out_bad,
                      peak.nan_to_num(-inf, -inf, -inf), low6[:4],
                      out_peak.nan_to_num(-inf, -inf, -inf), low6[:1], events, high1])


def count_nonfinite(x: torch.Tensor) -> torch.Tensor:
    """Number of NaN/inf elements, as a float32 scalar.

    ``x * 0`` is NaN exactly at the non-finite elements and 0 elsewhere, so counting its
    non-zeros counts them: on the CPU several times cheaper than ``isfinite().sum()``.
    """
    count: torch.Tensor = torch.count_nonzero(x * 0).float()
    return count


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
