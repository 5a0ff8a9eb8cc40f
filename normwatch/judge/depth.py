"""The gradient ledger by depth, and the alarms it raises (pure).

    >>> profile = depth_profile(snapshot, order)      # hidden-state gradient RMS by depth
    >>> profile.ratio                                  # first norm / last norm
    >>> gradient_alarms(snapshot, order, decay_ratio=0.5, profile=profile)

Where a norm sits decides how gradients flow (the second source article). Pre-norm
(``h + F(LN(h))``): the norm is on a residual branch, its input is also the trunk, and the
hidden state's gradient reaches every depth along the identity path: bottom/top > 1,
growing like sqrt(L). Post-norm (``LN(h + F(h))``): the norm sits on the trunk after the
add, every hop pays its Jacobian, and the ratio falls below 1 and keeps falling with
depth (0.853, 0.715, 0.167 at L = 16, 64, 256 in the article's model).

The placement is read from the gradients themselves: a norm whose input nothing else
reads (its total input gradient equals the gradient through it) sits on the trunk after
the add (post); one whose input the residual also reads sits on a branch (pre). State it
with the ``placement`` option where the inference cannot see it.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from normwatch.judge.headroom import severity, steps_to_limit
from normwatch.records import FP16_MAX, Alarm, LayerStats, Snapshot

Placement = Literal["pre", "post", "unknown"]
SAME = 1e-4
"""Relative difference below which the total and through-norm input gradients agree."""
MIN_DECAY_POINTS = 8
"""``gradient_decay`` needs this many trunk norms: a decay *with depth* (4 blocks of two
norms); a 2-block model's few points say little about depth."""


QK_NORMS = "[qk]*_*norm"
"""The last name component of a query/key norm (``q_norm``, ``kv_a_layernorm``; OLMo2's and
EXAONE 4's post-branch models have no pre-norm to tell the trunk by)."""


@dataclass(frozen=True)
class DepthPoint:
    """One norm on the depth profile."""

    layer: str
    depth: int
    """Position in forward order among the norms with a measured gradient."""
    hidden_rms: float
    """RMS of the hidden state's gradient where the norm meets the trunk (:func:`trunk_rms`)."""
    placement: Placement


@dataclass(frozen=True)
class DepthProfile:
    """Hidden-state gradient RMS by depth for one flush."""

    points: tuple[DepthPoint, ...]

    @property
    def ratio(self) -> float:
        """First norm's hidden gradient RMS over the last one's (< 1: it decays toward
        the input)."""
        return self.points[0].hidden_rms / self.points[-1].hidden_rms

    @property
    def slope(self) -> float:
        """Least-squares slope of log RMS against depth scaled to [0, 1], each norm against
        its peers (:func:`role`: the same norm of other blocks; one intercept per role):
        > 0 when the gradient shrinks toward the input. Norms of different roles may sit
        at different scales (a multi-stream hyper-connection norm and the block's own);
        alternating between them is not depth."""
        n = len(self.points)
        groups: dict[str, list[tuple[float, float]]] = {}
        for p in self.points:
            groups.setdefault(role(p.layer), []).append(
                (p.depth / max(n - 1, 1), math.log(p.hidden_rms)))
        sxy = sxx = 0.0
        for pairs in groups.values():
            mx = sum(x for x, _ in pairs) / len(pairs)
            my = sum(y for _, y in pairs) / len(pairs)
            sxy += sum((x - mx) * (y - my) for x, y in pairs)
            sxx += sum((x - mx) ** 2 for x, _ in pairs)
        return sxy / sxx if sxx else 0.0

    @property
    def fitted_ratio(self) -> float:
        """First over last of the fitted trend (``exp(-slope)``): the decay the whole
        profile shows, which one norm at either end (a final norm read straight by the
        head) cannot decide alone."""
        return math.exp(-self.slope)

    def count(self, placement: Placement) -> int:
        return sum(p.placement == placement for p in self.points)


def role(layer: str) -> str:
    """A norm's role in its block: its name with the block numbers taken out
    (``model.layers.3.input_layernorm`` → ``model.layers.#.input_layernorm``)."""
    return ".".join("#" if part.isdigit() else part for part in layer.split("."))


def placement_of(stats: LayerStats, stated: Mapping[str, str] | None = None) -> Placement:
    """The placement of one norm: stated (glob patterns of layer names), else inferred
    from its input gradients (see the module docstring)."""
    for pattern, where in (stated or {}).items():
        if fnmatch.fnmatchcase(stats.name, pattern):
            return "pre" if where == "pre" else "post"
    total, through = stats.grad_hidden_rms, stats.grad_in_rms
    if total is None or through is None or not total:
        return "unknown"
    return "post" if abs(total - through) <= SAME * total else "pre"


def depth_profile(snapshot: Snapshot, order: Sequence[str],
                  stated: Mapping[str, str] | None = None) -> DepthProfile | None:
    """The profile of the trunk's norms (forward ``order``) whose hidden-state gradient
    was measured with a positive finite RMS; ``None`` with fewer than 3 of them.

    In a model with pre-norms the trunk is what they read: its norms whose input nothing
    else reads are then off the trunk (a final norm, a q/k norm, the post-branch norm of a
    sandwich) and left out. Without pre-norms, every norm is taken but the q/k norms
    (:data:`QK_NORMS`, by name: inside attention, their gradients are the queries' and
    keys', not the trunk's)."""
    found = []
    for stats in in_order(snapshot, order):
        if fnmatch.fnmatchcase(stats.name.rsplit(".", 1)[-1].lower(), QK_NORMS):
            continue
        where = placement_of(stats, stated)
        rms = trunk_rms(stats, where)
        if rms is not None and math.isfinite(rms) and rms > 0:
            found.append((stats.name, rms, where))
    if any(where == "pre" for _, _, where in found):
        found = [f for f in found if f[2] != "post"]
    if len(found) < 3:
        return None
    return DepthProfile(tuple(DepthPoint(name, i, rms, where)
                              for i, (name, rms, where) in enumerate(found)))


def in_order(snapshot: Snapshot, order: Sequence[str]) -> list[LayerStats]:
    """The snapshot's layers in forward ``order``, then those it does not name."""
    return [snapshot.layers[n] for n in order if n in snapshot.layers] + \
        [s for n, s in snapshot.layers.items() if n not in order]


def worst_fp16_gradient(snapshot: Snapshot) -> LayerStats | None:
    """The fp16 layer with the largest measured dL/dy (``None``: no such layer)."""
    fp16 = [s for s in snapshot.layers.values() if s.fp16 and s.grad_out_absmax is not None]
    return max(fp16, key=lambda s: s.grad_out_absmax or 0.0, default=None)


def trunk_rms(stats: LayerStats, placement: Placement) -> float | None:
    """The hidden state's gradient RMS where the norm meets the trunk: at its input for
    a pre-norm (the residual stream it reads), at its output for a post-norm (the
    stream it writes; its input's gradient carries its own 1/sigma)."""
    if placement == "post" or stats.grad_hidden_rms is None:
        return stats.grad_out_rms
    return stats.grad_hidden_rms


def gradient_alarms(snapshot: Snapshot, order: Sequence[str], *, decay_ratio: float,
                    profile: DepthProfile | None = None,
                    grad_history: Sequence[tuple[int, float]] = (),
                    horizon: int = 1000, ratio: float = 0.25) -> list[Alarm]:
    """``gradient_nonfinite``, ``gradient_decay`` (from ``profile``, the snapshot's
    :func:`depth_profile`) and ``gradient_headroom`` findings."""
    out = _nonfinite(snapshot, order)
    if profile is not None and len(profile.points) >= MIN_DECAY_POINTS and \
            profile.ratio < decay_ratio and profile.fitted_ratio < decay_ratio:
        post = profile.count("post")
        where = (f"{post} of {len(profile.points)} norms sit on the trunk after the residual "
                 "add (post-norm): every hop pays the norm's Jacobian" if post else
                 "the norms sit on residual branches, so the decay comes from elsewhere")
        first, last = profile.points[0], profile.points[-1]
        out.append(Alarm(
            "gradient_decay", "warning", first.layer, snapshot.step, profile.ratio,
            decay_ratio,
            f"The hidden state's gradient decays toward the input: RMS {first.hidden_rms:.3g} "
            f"at {first.layer!r} against {last.hidden_rms:.3g} at {last.layer!r} (ratio "
            f"{profile.ratio:.3g} < {decay_ratio:g}; the trend over its "
            f"{len(profile.points)} norms {profile.fitted_ratio:.3g}), falling with depth; "
            f"{where}. Deep "
            "layers learn slowly and the loss plateaus. Use pre-norm (h + F(LN(h))) with a "
            "final norm, or warm the learning rate up."))
    out += _headroom(snapshot, grad_history, horizon, ratio)
    return out


def _nonfinite(snapshot: Snapshot, order: Sequence[str]) -> list[Alarm]:
    """The first norm in backward order whose gradients hold NaN/inf."""
    backward = in_order(snapshot, order)[::-1]
    measured = [s for s in backward if s.grad_out_rms is not None or s.grad_out_nonfinite]
    for i, s in enumerate(measured):
        if s.grad_out_nonfinite:
            if i == 0:
                what = ("arrived at the output of the last norm: the loss or the head's "
                        "backward produced it")
            else:
                what = (f"was born between {measured[i - 1].name!r} and {s.name!r} (in "
                        "backward order): the attention/MLP backward between them, or the "
                        "residual add")
            tag = "arrived" if i == 0 else "born"
        elif s.grad_in_nonfinite:
            what, tag = "was born in the norm's own backward (its input's gradient is "\
                "non-finite, its output's is not): check its eps and dtype", "norm"
        else:
            continue
        count = s.grad_out_nonfinite + s.grad_in_nonfinite
        return [Alarm("gradient_nonfinite", "critical", s.name, snapshot.step, float(count),
                      0.0, f"Non-finite gradient at {s.name!r} (first in backward order): it "
                      f"{what}.", tag=tag)]
    return []


def _headroom(snapshot: Snapshot, history: Sequence[tuple[int, float]],
              horizon: int, ratio: float) -> list[Alarm]:
    """fp16 runs: the largest gradient is past, or heading for, 65504 (loss scaling
    multiplies it; the scaler then skips steps). With a watched loss scaler the gradients
    are reported unscaled and their fp16 range is the scaler's job: no alarm."""
    worst = worst_fp16_gradient(snapshot)
    if worst is None or snapshot.loss_scale is not None:
        return []
    peak = worst.grad_out_absmax or 0.0
    if peak > FP16_MAX:
        return [Alarm("gradient_headroom", "critical", worst.name, snapshot.step, peak, FP16_MAX,
                      f"The gradient at {worst.name!r} reaches |g| = {peak:.4g} > 65504: it "
                      "overflows fp16 (with a GradScaler: skipped steps, shrinking scale).")]
    forecast = steps_to_limit(history, FP16_MAX)
    said = severity(peak, FP16_MAX, forecast, ratio, horizon)
    if forecast is None or said is None:
        return []
    return [Alarm("gradient_headroom", said, worst.name, snapshot.step, forecast.steps,
                  float(horizon),
                  f"The largest gradient (|g| = {peak:.4g} at {worst.name!r}) grows "
                  f"{100 * (forecast.growth_per_step - 1):.2g} % per step: it overflows fp16 in "
                  f"about {forecast.steps:.0f} steps (loss scale included). Lower the loss "
                  "scale's growth or clip gradients.")]
