"""A snapshot as flat ``{name: number}`` metrics for experiment loggers (pure).

    >>> flat_metrics(snapshot, watch.alarms, len(watch.verdicts), limits=watch.config.limits)
    {'normwatch/blocks.0.norm1/absmax': 3.2, ..., 'normwatch/alarms/critical': 0.0}

The per-layer statistics are those :data:`normwatch.catalog.TABLE` marks ``logged``.
Only finite numbers are returned, so loggers never receive NaN; layers not called in the
interval are left out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from normwatch.catalog import TABLE, layer_values
from normwatch.records import SEVERITIES, Alarm, Limits, Snapshot

LOGGED = tuple(s.name for s in TABLE if s.logged)


def flat_metrics(snapshot: Snapshot, alarms: Sequence[Alarm] = (), verdicts: int = 0,
                 prefix: str = "normwatch/", limits: Limits | None = None) -> dict[str, float]:
    """Per-layer statistics (fp16 headroom against ``limits``), cumulative alarm counts by
    severity, and the number of verdicts."""
    limits = limits or Limits()
    out: dict[str, float] = {}
    for name, stats in snapshot.layers.items():
        if not stats.seen:
            continue
        measured = layer_values(stats, limits)
        for field in LOGGED:
            value = measured[field]
            if value is not None and math.isfinite(value):
                out[f"{prefix}{name}/{field}"] = float(value)
    for severity in SEVERITIES:
        out[f"{prefix}alarms/{severity}"] = float(
            sum(a.count for a in alarms if a.severity == severity))
    out[f"{prefix}verdicts"] = float(verdicts)
    return out
