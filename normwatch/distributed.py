"""Across ranks: combine per-rank snapshots with one collective (at flush only).

    >>> combined = aggregate(snapshot)   # max of peaks, sum of counts over all ranks

Used for ``prometheus_aggregate=True`` on large jobs so that one set of per-layer series
describes every rank. A no-op unless ``torch.distributed`` is initialised.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from normwatch.snapshot import LayerStats, Snapshot

MAX_FIELDS = ("absmax", "sumsq_max", "rms_max", "eps_dominance", "common_mode_max",
              "out_absmax", "output_mismatch")
SUM_FIELDS = ("calls", "tokens", "finite_tokens", "stats_tokens", "fp16_overflow_tokens",
              "eps_dominated_tokens", "common_mode_tokens", "nonfinite", "out_nonfinite")


def active() -> bool:
    """Whether a process group is up with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def aggregate(snapshot: Snapshot) -> Snapshot:
    """Max/sum every layer's statistics over all ranks; every rank must call it."""
    if not active():
        return snapshot
    names = list(snapshot.layers)
    fields = MAX_FIELDS + SUM_FIELDS
    rows = [[_value(snapshot.layers[n], f) for f in fields] for n in names]
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor(rows, dtype=torch.float64, device=device).reshape(len(names), len(fields))
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    every = torch.stack(gathered).cpu()
    peaks = every[..., : len(MAX_FIELDS)].amax(0)
    counts = every[..., len(MAX_FIELDS):].sum(0)
    layers = {}
    for i, name in enumerate(names):
        s = snapshot.layers[name]
        update: dict[str, object] = {f: _back(float(peaks[i, j])) for j, f in
                                     enumerate(MAX_FIELDS)}
        update.update({f: int(counts[i, j]) for j, f in enumerate(SUM_FIELDS)})
        layers[name] = dataclasses.replace(s, **update)  # type: ignore[arg-type]
    return dataclasses.replace(snapshot, layers=layers)


def _value(stats: LayerStats, field: str) -> float:
    value = getattr(stats, field)
    return -math.inf if value is None else float(value)


def _back(value: float) -> float | None:
    return value if math.isfinite(value) else None
