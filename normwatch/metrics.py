"""A snapshot as flat ``{name: number}`` metrics for experiment loggers (pure).

    >>> flat_metrics(snapshot, watch.alarms, len(watch.verdicts))
    {'normwatch/blocks.0.norm1/absmax': 3.2, ..., 'normwatch/alarms/critical': 0.0}

Only finite numbers are returned, so loggers never receive NaN; layers not called in the
interval are left out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from normwatch.alarms import SEVERITY_RANK, Alarm
from normwatch.snapshot import Snapshot

LAYER_FIELDS = ("absmax", "rms_mean", "rms_max", "eps_dominance", "common_mode_max",
                "out_absmax", "nonfinite", "out_nonfinite", "fp16_overflow_tokens")


def flat_metrics(snapshot: Snapshot, alarms: Sequence[Alarm] = (), verdicts: int = 0,
                 prefix: str = "normwatch/", fp16_limit: float = 256.0) -> dict[str, float]:
    """Per-layer statistics, fp16 headroom, cumulative alarm counts by severity, verdicts."""
    out: dict[str, float] = {}
    for name, stats in snapshot.layers.items():
        if not stats.seen:
            continue
        for field in LAYER_FIELDS:
            value = getattr(stats, field)
            if value is not None and math.isfinite(value):
                out[f"{prefix}{name}/{field}"] = float(value)
        if stats.absmax:
            out[f"{prefix}{name}/fp16_headroom"] = fp16_limit / stats.absmax
    for severity in SEVERITY_RANK:
        out[f"{prefix}alarms/{severity}"] = float(
            sum(a.count for a in alarms if a.severity == severity))
    out[f"{prefix}verdicts"] = float(verdicts)
    return out
