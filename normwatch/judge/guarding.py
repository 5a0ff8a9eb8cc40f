"""What the guard's poisoned steps say (pure): one line per flush for the skipped steps,
a critical alarm when the bound is reached.

    >>> guard_alarms(events, step=40, max_skips=8)
"""

from __future__ import annotations

from collections.abc import Sequence

from normwatch.records import Alarm, GuardEvent


def guard_alarms(events: Sequence[GuardEvent], step: int, max_skips: int,
                 before: GuardEvent | None = None) -> list[Alarm]:
    """``guard_skipped`` (warning) naming the steps skipped since the last flush
    (``events``) and why; ``guard_exhausted`` (critical) at the first poisoned step applied
    because ``max_skips`` were skipped in a row before it (``before``: the event before
    these)."""
    out: list[Alarm] = []
    skipped = [e for e in events if e.skipped]
    if skipped:
        why = sorted({r for e in skipped for r in e.reasons})
        out.append(Alarm(
            "guard_skipped", "warning", None, step, float(len(skipped)), 0.0,
            f"The guard skipped {len(skipped)} optimizer step{'s' if len(skipped) > 1 else ''}"
            f" ({_steps(skipped)}): NaN/inf in {' and in '.join(why)}. Parameters and "
            "optimizer state are as if those steps had not been taken.",
            tag=str(skipped[0].step)))
    applied = [e for prev, e in zip([before, *events], events, strict=False)
               if not e.skipped and prev is not None and prev.skipped]
    if applied:
        out.append(Alarm(
            "guard_exhausted", "critical", None, step, float(len(applied)), float(max_skips),
            f"The guard skipped {max_skips} poisoned steps in a row and stopped: step "
            f"{applied[0].step} was applied with NaN/inf in {' and in '.join(applied[0].reasons)}"
            ". A run that keeps producing NaN is broken: skipping more would hide it.",
            tag=str(applied[0].step)))
    return out


def _steps(events: Sequence[GuardEvent]) -> str:
    steps = [e.step for e in events]
    if len(steps) > 6:
        return f"steps {', '.join(map(str, steps[:3]))}, ..., {steps[-1]}"
    return f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"
