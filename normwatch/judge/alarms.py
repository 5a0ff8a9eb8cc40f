"""Alarm records and the rules that raise them: pure functions of a snapshot.

    >>> alarms = evaluate(snapshot, context)   # list[Alarm], no side effects

Side effects (logging, sinks, raising, de-duplication) live in :mod:`normwatch.report.dispatch`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from normwatch.config import WatchConfig
from normwatch.judge.depth import DepthProfile, gradient_alarms
from normwatch.judge.headroom import CLOSE_FRACTION, severity, steps_to_limit
from normwatch.records import (
    FP16_MAX,
    Alarm,
    LayerStats,
    NormLayer,
    ProbeResult,
    Severity,
    Snapshot,
)

# Machine epsilon of the float dtypes by name (no torch here: the rules are pure).
DTYPE_EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10,
             "float8_e4m3fn": 2.0**-3, "float8_e5m2": 2.0**-2}

@dataclass(frozen=True)
class RuleContext:
    """What the rules may read besides the snapshot."""

    config: WatchConfig
    layers: Mapping[str, NormLayer]
    probes: Mapping[str, ProbeResult] = field(default_factory=dict)
    absmax_history: Mapping[str, Sequence[tuple[int, float]]] = field(default_factory=dict)
    order: Sequence[str] = ()
    """Layer names in forward order (the gradient rules walk them backwards)."""
    grad_history: Sequence[tuple[int, float]] = ()
    """``(step, largest |dL/dy| of the fp16 layers)`` per flush, oldest first."""
    profile: DepthProfile | None = None
    """The snapshot's hidden-state gradient by depth."""


def evaluate(snapshot: Snapshot, ctx: RuleContext) -> list[Alarm]:
    """Every alarm the snapshot deserves, in forward order of layers."""
    alarms: list[Alarm] = list(nonfinite_alarms(snapshot))
    for name, stats in snapshot.layers.items():
        if not stats.seen:
            continue
        layer = ctx.layers[name]
        step = snapshot.step
        alarms += fp16_alarms(stats, layer, step, ctx)
        alarms += eps_alarms(stats, layer, step, ctx.config)
        alarms += common_mode_alarms(stats, step, ctx.config)
        alarms += dtype_alarms(stats, layer, step)
        alarms += output_alarms(stats, step, ctx.config)
    alarms += gradient_alarms(snapshot, ctx.order, decay_ratio=ctx.config.gradient_decay_ratio,
                              profile=ctx.profile, grad_history=ctx.grad_history,
                              horizon=ctx.config.headroom_horizon,
                              ratio=ctx.config.headroom_ratio)
    return alarms


def nonfinite_alarms(snapshot: Snapshot) -> list[Alarm]:
    """One critical alarm naming the first layer (in forward order) that saw NaN/inf."""
    first = snapshot.first_nonfinite
    if first is None:
        return []
    total = sum(s.nonfinite + s.out_nonfinite for s in snapshot.layers.values())
    if first.origin == "input":
        what = (
            f"arrived in the input of {first.layer!r} (norm #{first.position} in forward "
            "order): the value was produced upstream, between the previous norm and this one "
            "(attention/MLP of that block, the residual add, or the data)"
        )
    else:
        what = (
            f"was born inside {first.layer!r} (norm #{first.position} in forward order): "
            "its input was finite and its output was not; check eps (0 on zero-variance "
            "tokens gives 0/0) and whether its reduction squares in fp16"
        )
    return [
        Alarm(
            "nonfinite", "critical", first.layer, first.step, float(total), 0.0,
            f"First non-finite value at step {first.step}: it {what}.",
            tag=first.origin,
        )
    ]


def fp16_alarms(stats: LayerStats, layer: NormLayer, step: int, ctx: RuleContext) -> list[Alarm]:
    """Past the fp16 element limit, past the sum-of-squares bound, or heading there."""
    limit = ctx.config.limits.fp16_limit
    fp16 = stats.fp16
    probe = ctx.probes.get(stats.name)
    name = stats.name
    out: list[Alarm] = []
    if stats.absmax is not None and stats.absmax > limit:
        share = f"{stats.fp16_overflow_tokens} of {stats.finite_tokens} tokens"
        if fp16 and probe is not None and probe.element_safe is False:
            sev: Severity = "critical"
            msg = (
                f"{name}: max |x| = {stats.absmax:.4g} > {limit:g} in {share}, and this "
                "layer squares its input in fp16 (probe: x=300 gave a wrong output): x² "
                "overflows to inf, rsqrt(inf) = 0 collapses those tokens to zero, and once x "
                "itself reaches inf the output is NaN. "
                "Compute the reduction in fp32 (x.float().pow(2).mean(-1)) or use torch's norm."
            )
        elif fp16:
            upcasts = _upcasts(probe)
            sev = "warning" if not upcasts or _heading(stats.absmax, name, FP16_MAX, ctx) \
                else "info"
            msg = (
                f"{name}: max |x| = {stats.absmax:.4g} > {limit:g} in {share} of an fp16 "
                f"run. The norm {'upcasts internally' if upcasts else 'may be fp16-safe'}, "
                "but fp16 tensors this large are one square away from inf (65504) in the "
                "residual stream, attention scores or a custom kernel. "
                + ("Find what grows the residual stream; consider bf16." if sev == "warning"
                   else "Not heading for 65504: fine while it stays so (the same forecast "
                        "rule as below 256 says when it is).")
            )
        else:
            sev = "info"
            msg = (
                f"{name}: max |x| = {stats.absmax:.4g} would overflow x² in fp16 "
                f"({share}). In {stats.input_dtype} it is representable; in bf16 such "
                "values carry ~0.4 % rounding error."
            )
        out.append(Alarm("fp16_overflow", sev, name, step, stats.absmax, limit, msg, tag="abs"))
    elif stats.sumsq_max is not None and stats.sumsq_max > FP16_MAX and fp16:
        unsafe = probe is not None and probe.sum_safe is False
        squares = probe is not None and probe.element_safe is False
        msg = (
            f"{name}: a token's sum of squares reaches {stats.sumsq_max:.4g} > 65504 "
            f"(max |x| {stats.absmax:.4g}, RMS up to {stats.rms_max:.4g})."
        )
        if unsafe:
            msg += (" This layer sums squares in fp16 (probe failed), so that sum is inf and "
                    "the output collapses. Accumulate the reduction in fp32.")
        elif squares:  # the probe's finding, the same words as past the limit
            msg += (f" Its sum does not overflow, but this layer squares its input in fp16 "
                    f"(probe: x=300 gave a wrong output): it fails once max |x| passes "
                    f"{limit:g}. Compute the reduction in fp32.")
        elif probe is not None:
            msg += " This norm accumulates safely (probed); a kernel summing squares in fp16 " \
                   "would not."
        else:
            msg += " A kernel summing squares in fp16 would overflow here."
        out.append(Alarm("fp16_overflow", "critical" if unsafe else "warning" if squares
                         else "info", name, step, stats.sumsq_max, FP16_MAX, msg, tag="sumsq"))
    if all(a.severity == "info" for a in out):  # (an accumulation that is safe: a trend)
        out += _headroom(stats, step, ctx, fp16)
    return out


def _upcasts(probe: ProbeResult | None) -> bool:
    """Whether the probe found that the norm computes in fp32 (x = 300 gave a right output)."""
    return probe is not None and probe.element_safe is True


def _heading(value: float, name: str, limit: float, ctx: RuleContext) -> bool:
    """Whether the layer's max |x| trend deserves a warning of reaching ``limit``."""
    trend = steps_to_limit(ctx.absmax_history.get(name, ()), limit)
    return severity(value, limit, trend, ctx.config.headroom_ratio,
                    ctx.config.headroom_horizon) == "warning"


def _headroom(stats: LayerStats, step: int, ctx: RuleContext, fp16: bool) -> list[Alarm]:
    limit = ctx.config.limits.fp16_limit
    if stats.absmax is None or not CLOSE_FRACTION * limit <= stats.absmax <= limit:
        return []
    forecast = steps_to_limit(ctx.absmax_history.get(stats.name, ()), limit)
    said = severity(stats.absmax, limit, forecast, ctx.config.headroom_ratio,
                    ctx.config.headroom_horizon)
    if forecast is None or said is None or (not fp16 and said == "info"):
        return []  # (another dtype: a note only where fp16 would warn)
    # a norm that upcasts is judged past 256 against 65504 (fp16_overflow), and below 256
    # the stream is never near that: at most info
    upcasts = fp16 and _upcasts(ctx.probes.get(stats.name))
    said = "info" if upcasts else said
    growth = (forecast.growth_per_step - 1) * 100
    msg = (
        f"{stats.name}: max |x| = {stats.absmax:.4g}, growing {growth:.2g} %/step: "
        f"~{forecast.steps:.0f} steps to the fp16 limit {limit:g} at the current rate."
    )
    if not fp16:
        msg += " Harmless in this dtype; fatal in fp16."
    elif upcasts:
        msg += (" The norm upcasts internally: 256 is no overflow here; past it, the "
                "stream is judged against 65504.")
    elif said == "warning":
        msg += (" Act before it overflows: find what grows (lr, residual scale, a bad batch), "
                "or checkpoint now.")
    else:
        msg += (f" Still {limit / stats.absmax:.0f}x below it: growth this far out often "
                "levels off (a warning once it is near and has covered half the way).")
    return [Alarm("fp16_headroom", said if fp16 else "info", stats.name, step,
                  forecast.steps, float(ctx.config.headroom_horizon), msg)]


def eps_alarms(stats: LayerStats, layer: NormLayer, step: int, config: WatchConfig) -> list[Alarm]:
    """Tokens whose variance (mean square for RMSNorm) is small against eps."""
    if not stats.eps_dominated_tokens or stats.eps_dominance is None:
        return []
    s_name = "mean square" if stats.kind == "rmsnorm" else "variance"
    share = f"{stats.eps_dominated_tokens} of {stats.stats_tokens} tokens"
    if layer.eps == 0 and stats.eps_dominance >= 1.0:
        return [Alarm(
            "eps_dominance", "critical", stats.name, step, stats.eps_dominance,
            config.limits.eps_tol,
            f"{stats.name}: eps = 0 and {share} have zero {s_name}: x/sqrt(0 + 0) = 0/0 = NaN. "
            "Set eps to 1e-6..1e-5 and mask padding tokens.", tag="zero-eps")]
    # Output RMS shrinks to sqrt(1 - ratio): under 5 % (ratio <= 0.1) is worth knowing,
    # not worth waking anyone.
    sev: Severity = "warning" if stats.eps_dominance > 0.1 else "info"
    return [Alarm(
        "eps_dominance", sev, stats.name, step, stats.eps_dominance, config.limits.eps_tol,
        f"{stats.name}: eps = {layer.eps_written:g} dominates {share} (eps/({s_name} + eps) "
        f"up to {stats.eps_dominance:.3g} > {config.limits.eps_tol:g}): their output is "
        f"flattened to RMS sqrt(s/(s+eps)). {_eps_advice(layer.eps_written)}")]


USUAL_EPS = 1e-5
"""The largest eps in the usual range (1e-6..1e-5)."""


def _eps_advice(eps: float) -> str:
    """What to do about eps dominance, for the layer's own eps."""
    if eps > USUAL_EPS:
        return "Lower eps to 1e-6..1e-5, or mask zero/padding tokens."
    return ("This eps is already in the usual range: the tokens themselves are small (common "
            "at initialisation; it fades as training grows them). If it persists, mask "
            "zero/padding tokens or lower eps further.")


def common_mode_alarms(stats: LayerStats, step: int, config: WatchConfig) -> list[Alarm]:
    """RMSNorm inputs whose mean dominates their RMS (RMSNorm does not remove it)."""
    if stats.kind != "rmsnorm" or not stats.stats_tokens or stats.common_mode_max is None:
        return []
    share = stats.common_mode_tokens / stats.stats_tokens
    if share <= config.limits.common_mode_fraction:
        return []
    return [Alarm(
        "common_mode", "warning", stats.name, step, share, config.limits.common_mode_fraction,
        f"{stats.name}: {share:.0%} of tokens have |mean|/RMS > {config.limits.common_mode_tol:g} "
        f"(max {stats.common_mode_max:.3g}): RMSNorm keeps the common mode, so the token's "
        "structure is crushed into a near-constant vector. Consider LayerNorm or centring.")]


def dtype_alarms(stats: LayerStats, layer: NormLayer, step: int) -> list[Alarm]:
    """Weight or output dtype different from the input, beyond autocast's own rules.

    Under autocast, an fp32 output made by an op autocast runs in fp32 (CUDA's
    ``layer_norm``, asked of autocast by op: ``stats.autocast_made``) is by design; any
    other fp32 output of a lower-precision stream (a norm's fp32 weight multiplying it) is
    plain type promotion in the norm's own code: info under autocast (it costs memory, not
    digits, and the next autocast op casts it back: the ``transformers`` code of Qwen3's
    q/k norms and MLA's latent norms does it on every healthy bf16 run), a warning
    without. Without an autograd node to tell (no-grad calls), torch's own norm modules are
    taken as autocast's.
    """
    inp, w, out = stats.input_dtype, stats.weight_dtype, stats.output_dtype
    if inp is None or out is None:
        return []
    tag = f"{inp}/{w}/{out}/{stats.autocast}"
    if stats.autocast is not None:
        amp = stats.autocast.split(":")[-1]
        by_autocast = layer.builtin if stats.autocast_made is None else stats.autocast_made
        if out == "float32" != inp and not by_autocast:
            return [Alarm(
                "dtype_mismatch", "info", stats.name, step, 0.0, 0.0,
                f"{stats.name}: under autocast ({amp}) the {inp} stream leaves this norm as "
                f"{out}: its {w} weight promotes it by plain type promotion in the norm's own "
                "code, not by an autocast rule (2x memory and bandwidth until the next autocast "
                "op casts it back). To save them, cast the result back to the input dtype, "
                "e.g. (weight * x).to(input_dtype).", tag=tag)]
        if out in (inp, amp, "float32") and w in (None, "float32", inp):
            return []
        return [Alarm("dtype_mismatch", "info", stats.name, step, 0.0, 0.0,
                      f"{stats.name}: under autocast ({amp}) input {inp}, weight {w}, output "
                      f"{out}: not one of autocast's documented promotions.", tag=tag)]
    problems = []
    if w is not None and w != inp:
        if _resolution(w) > _resolution(inp):
            problems.append(f"weight {w} is less precise than the {inp} input it scales "
                            "(digits are lost after the fp32 reduction)")
        else:
            problems.append(f"weight {w} differs from the {inp} input")
    if out != inp:
        problems.append(f"output is {out}: the {inp} stream is promoted (2x memory and "
                        "bandwidth downstream, numerics that differ from inference)")
    if not problems:
        return []
    # a coarser weight on a stream the norm gives back unchanged (a model cast whole,
    # whose code upcasts its stream): the weight's own precision, not a mismatch to fix
    coarser = out == inp and w is not None and _resolution(w) > _resolution(inp)
    sev: Severity = "info" if coarser else "warning"
    return [Alarm("dtype_mismatch", sev, stats.name, step, 0.0, 0.0,
                  f"{stats.name}: " + "; ".join(problems) +
                  ". Cast the norm with the model (model.to(dtype)) or use autocast.", tag=tag)]


def output_tolerance(config: WatchConfig, stats: LayerStats) -> float:
    """Relative error that counts as an output mismatch: 4 units of the coarsest precision
    the output went through — its input, output and autocast dtypes, and the precision its
    values actually carry (``output_eps``, from their mantissas: an fp32 output whose last
    rounding happened in bf16 carries bf16's digits) — at least 1e-3."""
    if config.limits.output_tol is not None:
        return config.limits.output_tol
    amp = stats.autocast.split(":")[-1] if stats.autocast else None
    dtypes = [d for d in (stats.input_dtype, stats.output_dtype, amp) if d] or ["float32"]
    units = [DTYPE_EPS.get(d, 1e-7) for d in dtypes]
    if stats.output_eps is not None:
        units.append(stats.output_eps)
    return max(1e-3, 4 * max(units))


def output_alarms(stats: LayerStats, step: int, config: WatchConfig) -> list[Alarm]:
    """The layer's output disagrees with its formula recomputed in fp32."""
    err = stats.output_mismatch
    tol = output_tolerance(config, stats)
    if err is None or err <= tol:
        return []
    sev: Severity = "critical" if err > 0.1 else "warning"
    return [Alarm(
        "output_mismatch", sev, stats.name, step, err, tol,
        f"{stats.name}: output differs from the fp32 {stats.kind} formula by up to "
        f"{err:.3g} (relative, per token; tolerance {tol:.2g}). Suspect a reduction over "
        "the wrong dimension (batch instead of features), a misplaced eps, or an fp16 "
        "reduction that overflowed to zeros.")]


def _resolution(dtype: str) -> float:
    return DTYPE_EPS.get(dtype, 0.0)
