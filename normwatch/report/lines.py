"""The one-line messages a watch prints: when it attaches, each verdict, when it ends.

    >>> attach_line("TinyLM", layers, flush_every=10, report_dir="normwatch-reports")
    'normwatch: watching TinyLM: 5 norm layers (5 RMSNorm), flush every 10 steps, ...'

Pure functions of plain records; the console view prints them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from normwatch.records import SEVERITIES, Alarm, NormLayer, Verdict


def attach_line(model: str, layers: Sequence[NormLayer], flush_every: int,
                report_dir: str | None) -> str:
    """What is watched, how often it is read, where reports go."""
    kinds = Counter(layer.class_name for layer in layers)
    listed = ", ".join(f"{n} {name}" for name, n in kinds.most_common())
    where = f"reports to {report_dir}" if report_dir is not None else "no reports"
    return (f"normwatch: watching {model}: {len(layers)} norm layer"
            f"{'' if len(layers) == 1 else 's'} ({listed or 'none'}), flush every "
            f"{flush_every} step{'' if flush_every == 1 else 's'}, {where}")


def verdict_line(verdict: Verdict) -> str:
    """A verdict: what triggered where, who is to blame, the first evidence."""
    blamed = verdict.blame.replace("_", " ")
    where = f" ({verdict.layer})" if verdict.layer else ""
    cause = f", cause {verdict.cause}" if verdict.cause else ""
    evidence = f": {verdict.evidence[0]}" if verdict.evidence else ""
    return (f"normwatch VERDICT {verdict.trigger.replace('_', ' ')} at step {verdict.step}: "
            f"{blamed}{where}{cause}{evidence}")


def exit_line(model: str, steps: int, alarms: Sequence[Alarm], verdicts: Sequence[Verdict],
              reports: Sequence[Path], skipped: int = 0) -> str:
    """The end of a watch: steps, alarms by severity, verdicts, report folders."""
    counts = Counter(a.severity for a in alarms)
    by = ", ".join(f"{counts[s]} {s}" for s in reversed(SEVERITIES) if counts[s])
    line = (f"normwatch: {model}: {steps} step{'' if steps == 1 else 's'} watched"
            + (f" ({skipped} skipped by the loss scaler)" if skipped else "")
            + f"; alarms: {by or 'none'}; verdicts: {len(verdicts)}")
    if verdicts:
        line += " (" + ", ".join(f"{v.trigger} at {v.step}: {v.blame}" for v in verdicts[:3]) \
            + (", ..." if len(verdicts) > 3 else "") + ")"
    if reports:
        line += "; reports: " + ", ".join(str(p) for p in reports)
    return line
