"""The one table of per-layer statistics: each declared once, every consumer derived.

    >>> STATS["rms_mean"].derive({"rms_sum": 6.0, "stats_tokens": 3.0}, Limits())
    2.0

A :class:`Stat` says how a statistic is made (``source``: measured on the device, counted
on the host, or derived from others), how it combines across calls, steps and ranks
(``reduce``: sum, max or min; derived statistics are recomputed from their combined parts,
never averaged), what the user sees (``public``: a :class:`~normwatch.records.LayerStats`
field), its Prometheus family, whether logger metrics carry it, whether reports keep its
history, and its *tier* (when it is measured). The accumulator's columns, the cross-rank
combine, :class:`LayerStats`, the logger metrics, the Prometheus collector and the report
all iterate over :data:`STATS`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Literal

from normwatch.records import LayerStats, Limits

Reduce = Literal["sum", "max", "min"]
Source = Literal["device", "host", "derived"]
Tier = Literal["sentinel", "full", "check", "gradient"]
"""When a statistic is measured: ``sentinel`` every counted call, ``full`` on full-tier
steps (``stats_every``), ``check`` at output checks (``output_check_every``),
``gradient`` in the backward of full-tier steps."""
IDENTITY: dict[Reduce, float] = {"sum": 0.0, "max": -math.inf, "min": math.inf}


@dataclass(frozen=True)
class Metric:
    """A Prometheus family fed by one statistic (``normwatch_`` + ``name``)."""

    name: str
    type: Literal["gauge", "counter"]
    help: str
    labels: tuple[tuple[str, str], ...] = ()
    """Fixed extra labels, for families shared by several statistics."""


@dataclass(frozen=True)
class Stat:
    """One per-layer statistic; see the module docstring."""

    name: str
    help: str
    source: Source = "device"
    reduce: Reduce | None = None
    """How raw values combine across calls, steps and ranks (``None``: derived)."""
    derive: Callable[[Mapping[str, float], Limits], float | None] | None = None
    """Derived statistics: the value from the combined raw row and the limits."""
    integer: bool = False
    public: bool = True
    """A :class:`~normwatch.records.LayerStats` field."""
    metric: Metric | None = None
    logged: bool = False
    """In the flat ``normwatch/<layer>/<name>`` logger metrics."""
    history: bool = False
    """Kept per flush in ``report.json``."""
    tier: Tier = "full"
    """When it is measured (see :data:`Tier`); a derived statistic has its parts'."""

    def value(self, raw: Mapping[str, float], limits: Limits) -> float | int | None:
        """The user-facing value from a combined raw row: counts as ints, reduction
        identities (nothing measured) as ``None``."""
        if self.derive is not None:
            return self.derive(raw, limits)
        v = raw[self.name]
        if self.integer:
            return int(v)
        return v if math.isfinite(v) else None


def _rms_mean(raw: Mapping[str, float], limits: Limits) -> float | None:
    n = raw["stats_tokens"]
    return raw["rms_sum"] / n if n else None


def _headroom(raw: Mapping[str, float], limits: Limits) -> float | None:
    absmax = raw["absmax"]
    return limits.headroom(absmax) if math.isfinite(absmax) else None


def _gauge(name: str, help_: str) -> Metric:
    return Metric(name, "gauge", help_)


_NONFINITE = "Tokens holding NaN/inf in a layer's input or output."

TABLE: tuple[Stat, ...] = (
    # device sums
    Stat("calls", "Norm calls counted.", reduce="sum", integer=True, tier="sentinel"),
    Stat("tokens", "Tokens measured.", reduce="sum", integer=True,
         metric=Metric("tokens", "counter", "Tokens measured per layer."), history=True,
         tier="sentinel"),
    Stat("finite_tokens", "Tokens without NaN/inf.", reduce="sum", integer=True, tier="sentinel"),
    Stat("stats_tokens", "Finite tokens measured with the full statistics.", reduce="sum",
         integer=True),
    Stat("fp16_overflow_tokens", "Tokens whose max |x| exceeds the fp16 limit.", reduce="sum",
         integer=True, logged=True,
         metric=Metric("fp16_limit_tokens", "counter",
                       "Tokens whose max |x| exceeded the fp16 limit."), tier="sentinel"),
    Stat("rms_sum", "Sum of per-token RMS (the numerator of rms_mean).", reduce="sum",
         public=False),
    Stat("eps_dominated_tokens", "Tokens where eps/(s + eps) exceeds eps_tol.", reduce="sum",
         integer=True, history=True),
    Stat("common_mode_tokens", "Tokens where |mean|/RMS exceeds common_mode_tol.",
         reduce="sum", integer=True),
    Stat("nonfinite", "Input tokens holding NaN/inf.", reduce="sum", integer=True, logged=True,
         history=True, metric=Metric("nonfinite_tokens", "counter", _NONFINITE,
                                     (("where", "input"),)), tier="sentinel"),
    Stat("out_nonfinite", "Output tokens holding NaN/inf.", reduce="sum", integer=True,
         logged=True, history=True,
         metric=Metric("nonfinite_tokens", "counter", _NONFINITE, (("where", "output"),)),
         tier="sentinel"),
    # device maxima
    Stat("absmax", "Max |x| of the input.", reduce="max", logged=True, history=True,
         metric=_gauge("layer_absmax", "Max |x| of the layer's input over the last interval."),
         tier="sentinel"),
    Stat("sumsq_max", "Max over tokens of the sum of squares.", reduce="max", history=True),
    Stat("rms_max", "Max over tokens of the input's RMS.", reduce="max", logged=True,
         history=True,
         metric=_gauge("layer_rms_max", "Max over tokens of the input's per-token RMS.")),
    Stat("eps_dominance", "Max over tokens of eps/(s + eps).", reduce="max", logged=True,
         history=True, metric=_gauge(
             "layer_eps_dominance_ratio",
             "Max over tokens of eps / (s + eps), s = mean square (RMSNorm) or variance.")),
    Stat("common_mode_max", "Max over tokens of |mean|/RMS.", reduce="max", logged=True,
         history=True,
         metric=_gauge("layer_common_mode_ratio", "Max over tokens of |mean| / RMS.")),
    Stat("out_absmax", "Max |y| of the output.", reduce="max", logged=True, history=True,
         metric=_gauge("layer_output_absmax", "Max |y| of the layer's output."), tier="sentinel"),
    Stat("output_mismatch", "Max relative error of the output against the fp32 formula, "
         "over the checked tokens (layer/RMS norms: per call, those of largest |x| and of "
         "smallest range and a few spread evenly; other kinds: every token).",
         reduce="max", history=True, tier="check"),
    Stat("output_eps", "Precision the output carries: the eps of the coarsest format "
         "holding every checked output value exactly (bf16, fp16, else its own dtype).",
         reduce="max", tier="check"),
    Stat("first_arrived_score", "First call whose input held NaN/inf (see KEY_STRIDE).",
         reduce="max", public=False, tier="sentinel"),
    Stat("first_born_score", "First call whose output, not input, held NaN/inf.",
         reduce="max", public=False, tier="sentinel"),
    # device minima
    Stat("rms_min", "Min over tokens of the input's RMS.", reduce="min", history=True),
    # derived from the combined parts
    Stat("rms_mean", "Mean over tokens of the input's RMS.", "derived", derive=_rms_mean,
         logged=True, history=True,
         metric=_gauge("layer_rms_mean", "Mean over tokens of the input's per-token RMS.")),
    Stat("fp16_headroom", "fp16 limit / max |x| (below 1: overflow).", "derived",
         derive=_headroom, public=False, logged=True, tier="sentinel", metric=_gauge(
             "layer_fp16_headroom_ratio",
             "fp16 limit / max |x|: below 1 the layer's input overflows x^2 in fp16.")),
)


# -- gradients through each norm (see normwatch.measure.layer.gradients) ---------------------------

GRAD_SITES = {
    "grad_out": ("the gradient arriving at the output (dL/dy)", "output"),
    "grad_in": ("the gradient leaving through the input, through the norm only", "input"),
    "grad_hidden": ("the gradient at the input, in total (the hidden state's)", "hidden"),
}
"""Where gradients are measured, by column prefix: what it is, its ``where`` label."""
GRAD_SUMS = ("tokens", "finite", "sumsq", "elements")
"""Each site's summed columns, adjacent in :data:`COLUMNS` (one in-place add)."""


def _grad_rms(site: str) -> Callable[[Mapping[str, float], Limits], float | None]:
    def rms(raw: Mapping[str, float], limits: Limits) -> float | None:
        n = raw[f"{site}_elements"]
        return math.sqrt(raw[f"{site}_sumsq"] / n) if n else None
    return rms


def _grad_nonfinite(site: str) -> Callable[[Mapping[str, float], Limits], float | None]:
    return lambda raw, limits: int(raw[f"{site}_tokens"] - raw[f"{site}_finite"])


def _grad_gain(raw: Mapping[str, float], limits: Limits) -> float | None:
    into, out = _grad_rms("grad_in")(raw, limits), _grad_rms("grad_out")(raw, limits)
    return into / out if into is not None and out else None


def _weight_grad_norm(raw: Mapping[str, float], limits: Limits) -> float | None:
    n = raw["weight_grads"]
    return math.sqrt(raw["weight_grad_sumsq"] / n) if n else None


def _grad_stats(site: str) -> tuple[Stat, ...]:
    what, where = GRAD_SITES[site]
    return (
        Stat(f"{site}_tokens", f"Tokens of {what}.", reduce="sum", integer=True, public=False),
        Stat(f"{site}_finite", f"Finite tokens of {what}.", reduce="sum", integer=True,
             public=False),
        Stat(f"{site}_sumsq", f"Sum of squares over the finite tokens of {what}.",
             reduce="sum", public=False),
        Stat(f"{site}_elements", f"Elements of the finite tokens of {what}.", reduce="sum",
             public=False),
        Stat(f"{site}_absmax", f"Max |g| of {what}.", reduce="max", history=True,
             metric=Metric("layer_gradient_absmax", "gauge", "Max |g| of a norm's gradient.",
                           (("where", where),))),
        Stat(f"{site}_rms", f"RMS of {what}.", "derived", derive=_grad_rms(site),
             logged=site != "grad_in", history=True,
             metric=Metric("layer_gradient_rms", "gauge",
                           "RMS of a norm's gradient over the last interval.",
                           (("where", where),))),
        Stat(f"{site}_nonfinite", f"Tokens of {what} holding NaN/inf.", "derived",
             derive=_grad_nonfinite(site), integer=True, history=True),
    )


GRADIENTS: tuple[Stat, ...] = (
    *_grad_stats("grad_out"), *_grad_stats("grad_in"), *_grad_stats("grad_hidden"),
    Stat("grad_gain", "The norm's gradient gain: RMS of dL/dx through it / RMS of dL/dy.",
         "derived", derive=_grad_gain, logged=True, history=True,
         metric=_gauge("layer_gradient_gain_ratio",
                       "RMS of the gradient leaving a norm's input / arriving at its output.")),
    Stat("weight_grads", "Backward passes that reached the weight.", reduce="sum",
         integer=True, public=False),
    Stat("weight_grad_sumsq", "Sum over backward passes of the weight gradient's squared "
         "norm.", reduce="sum", public=False),
    Stat("weight_grad_norm", "RMS over backward passes of the weight gradient's norm.",
         "derived", derive=_weight_grad_norm, logged=True,
         metric=_gauge("layer_weight_gradient_norm",
                       "Norm of the norm layer's weight gradient (per backward, local).")),
)
TABLE = TABLE + tuple(replace(s, tier="gradient") for s in GRADIENTS)
STATS: dict[str, Stat] = {s.name: s for s in TABLE}


def _named(source: Source, reduce: Reduce | None = None) -> tuple[str, ...]:
    return tuple(s.name for s in TABLE if s.source == source and
                 (reduce is None or s.reduce == reduce))


SUM_COLUMNS = _named("device", "sum")
MAX_COLUMNS = _named("device", "max")
MIN_COLUMNS = _named("device", "min")
COLUMNS = SUM_COLUMNS + MAX_COLUMNS + MIN_COLUMNS
"""The accumulator's device columns, grouped by reduction."""
HOST_COLUMNS = _named("host")
RAW = COLUMNS + HOST_COLUMNS
"""Every combinable column: what crosses ranks."""
PUBLIC = tuple(s.name for s in TABLE if s.public)
"""The statistics :class:`~normwatch.records.LayerStats` carries, in table order."""


def identity_row(columns: Iterable[str] = RAW) -> list[float]:
    """Each column's reduction identity: 0 for sums, -inf for maxima, +inf for minima."""
    return [IDENTITY[STATS[c].reduce or "sum"] for c in columns]


def combine(rows: Iterable[Mapping[str, float]], columns: Iterable[str] = RAW
            ) -> dict[str, float]:
    """Combine raw rows column by column with each column's declared reduction (a NaN
    never replaces a maximum or a minimum)."""
    cols = tuple(columns)
    start, (sums, maxes, mins) = _by_reduction(cols)
    out = dict(start)
    for row in rows:
        for name in sums:
            out[name] += row[name]
        for name in maxes:
            if row[name] > out[name]:
                out[name] = row[name]
        for name in mins:
            if row[name] < out[name]:
                out[name] = row[name]
    return out


@functools.cache
def _by_reduction(columns: tuple[str, ...]
                  ) -> tuple[dict[str, float], tuple[tuple[str, ...], ...]]:
    """``columns`` at their identities, and split by reduction: sums, maxima, minima
    (once per tuple of columns: :func:`combine` runs per layer at every flush)."""
    return dict(zip(columns, identity_row(columns), strict=True)), tuple(
        tuple(c for c in columns if (STATS[c].reduce or "sum") == how)
        for how in ("sum", "max", "min"))


def values(raw: Mapping[str, float], limits: Limits) -> dict[str, float | int | None]:
    """Every statistic's user-facing value from one combined raw row (public and not)."""
    return {s.name: s.value(raw, limits) for s in TABLE if s.derive is not None or s.public}


def layer_values(stats: LayerStats, limits: Limits) -> dict[str, float | int | None]:
    """Every statistic of one layer's :class:`LayerStats`: its fields, and the derived
    statistics that are not fields (e.g. ``fp16_headroom``)."""
    fields = {name: getattr(stats, name) for name in PUBLIC}
    raw = {k: math.nan if v is None else float(v) for k, v in fields.items()}
    return fields | {s.name: s.value(raw, limits) for s in TABLE
                     if not s.public and s.derive is not None}


# The first non-finite event of an interval: a forward call's position is
# key = step * KEY_STRIDE + call index within the step; its score SCORE_BASE - key folds
# into a max column (0 = no event), so the earliest event has the largest score. Exact in
# float64.
KEY_STRIDE = 1 << 20
SCORE_BASE = float(1 << 52)


def decode_score(score: float) -> tuple[int, int] | None:
    """``(step, call index)`` from a first-non-finite score, ``None`` for no event."""
    if not math.isfinite(score) or score <= 0:
        return None
    key = int(SCORE_BASE - score)
    return key // KEY_STRIDE, key % KEY_STRIDE
