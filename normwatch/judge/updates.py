"""Did an optimizer step jump just before a trigger? (pure)

    >>> jump = update_jump(updates, step=120)     # UpdateStats of recent steps, oldest first
    >>> jump.ratio if jump else "normal"

The loss (and the activations) of step ``s`` come from the parameters the updates before
``s`` made, so the steps that can explain a trigger at ``s`` are the last :data:`RECENT`
ones before it. A step *jumped* when its update norm is :data:`UPDATE_JUMP` times the
median of the steps before it (at least :data:`MIN_UPDATES` of them), or is not finite.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from normwatch.records import UpdateStats

UPDATE_JUMP = 4.0
MIN_UPDATES = 5
RECENT = 3
BASELINE = 50
"""Steps before a candidate that its median is taken over (at most)."""


@dataclass(frozen=True)
class UpdateJump:
    """The largest jump among the steps just before a trigger."""

    update: UpdateStats
    ratio: float
    """Its update norm over the median before it (``inf`` when not finite)."""
    median: float
    lr_median: float | None
    grad_median: float

    def sentences(self) -> list[str]:
        """The evidence: the update, then what made it (learning rate or gradient). A
        non-finite update or gradient is said as such (no ratio, no clipping advice: a
        clipped NaN is still NaN)."""
        u = self.update
        if math.isfinite(u.update_norm):
            out = [f"The optimizer step at step {u.step} moved the parameters by "
                   f"{u.update_norm:.4g} (L2), {self.ratio:.0f}x the median {self.median:.4g} "
                   "of the steps before it."]
        else:
            out = [f"The optimizer step at step {u.step} wrote non-finite values into the "
                   f"parameters (its update norm is {_said(u.update_norm)}; the steps before "
                   f"it moved them by a median {self.median:.4g})."]
        causes = []
        if u.lr is not None and self.lr_median and u.lr > 2 * self.lr_median:
            causes.append(f"the learning rate was {u.lr:.4g}, {u.lr / self.lr_median:.0f}x its "
                          f"median {self.lr_median:.4g}")
        if not math.isfinite(u.grad_norm):
            causes.append(f"the gradient it received was not finite ({_said(u.grad_norm)})")
        elif self.grad_median > 0 and u.grad_norm > 2 * self.grad_median:
            causes.append(f"the gradient norm it received was {u.grad_norm:.4g}, against a "
                          f"median {self.grad_median:.4g} (clipping would have capped it)")
        if causes:
            out.append("At that step " + " and ".join(causes) + ".")
        return out


def _said(value: float) -> str:
    return "NaN" if math.isnan(value) else "infinite"


def known(updates: Sequence[UpdateStats], step: int) -> bool:
    """Whether enough steps before ``step`` were measured to judge them."""
    return sum(u.step < step for u in updates) >= MIN_UPDATES + 1


def update_jump(updates: Sequence[UpdateStats], step: int) -> UpdateJump | None:
    """The largest update jump among the :data:`RECENT` steps before ``step``, if any."""
    found: UpdateJump | None = None
    for i, u in enumerate(updates):
        if not step - RECENT <= u.step < step:
            continue
        before = [v for v in updates[max(0, i - BASELINE):i] if math.isfinite(v.update_norm)]
        if len(before) < MIN_UPDATES:
            continue
        median = statistics.median(v.update_norm for v in before)
        if math.isfinite(u.update_norm) and u.update_norm <= UPDATE_JUMP * median:
            continue
        ratio = u.update_norm / median if median > 0 and math.isfinite(u.update_norm) \
            else math.inf
        if found is None or ratio > found.ratio:
            lrs = [v.lr for v in before if v.lr is not None]
            grads = [v.grad_norm for v in before if math.isfinite(v.grad_norm)]
            found = UpdateJump(u, ratio, median, statistics.median(lrs) if lrs else None,
                               statistics.median(grads) if grads else 0.0)
    return found


def normal_before(updates: Sequence[UpdateStats], step: int) -> str | None:
    """When the steps before ``step`` are known and none jumped: a sentence saying so."""
    if not known(updates, step) or update_jump(updates, step) is not None:
        return None
    recent = [u for u in updates if step - RECENT <= u.step < step]
    earlier = [u.update_norm for u in updates if u.step < step - RECENT
               and math.isfinite(u.update_norm)][-BASELINE:]
    if not recent or not earlier:
        return None
    median = statistics.median(earlier)
    worst = max(u.update_norm for u in recent)
    return (f"The optimizer steps before it were normal: the largest update {worst:.4g} is "
            f"{worst / median:.1f}x the median {median:.4g} before them.") if median > 0 else None
