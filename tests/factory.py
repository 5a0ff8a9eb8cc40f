"""Hand-made records for unit tests of the pure stages (no model, no training loop).

    >>> s = snapshot(7, stats("blocks.0.norm", absmax=300.0, input_dtype="float16"))
    >>> evaluate(s, context(s))

``stats`` gives a healthy, fully measured layer (fp32, 100 finite tokens, RMS ~ 1); pass
any :class:`~normwatch.records.LayerStats` field to change it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from normwatch.config import WatchConfig
from normwatch.judge.alarms import RuleContext
from normwatch.records import FirstNonfinite, Kind, LayerStats, NormLayer, ProbeResult, Snapshot

HEALTHY: dict[str, Any] = dict(
    calls=2, tokens=100, finite_tokens=100, stats_tokens=100, absmax=3.0,
    fp16_overflow_tokens=0, sumsq_max=64.0, rms_min=0.8, rms_mean=1.0, rms_max=1.2,
    eps_dominance=1e-5, eps_dominated_tokens=0, common_mode_max=0.1, common_mode_tokens=0,
    nonfinite=0, out_nonfinite=0, out_absmax=3.5, output_mismatch=None, output_eps=None,
    input_dtype="float32", weight_dtype="float32", output_dtype="float32", autocast=None,
    grad_out_absmax=0.05, grad_out_rms=0.01, grad_in_absmax=0.05, grad_in_rms=0.01,
    grad_hidden_absmax=0.06, grad_hidden_rms=0.012, grad_gain=1.0, weight_grad_norm=0.1,
)


def stats(name: str = "blocks.0.norm", kind: Kind = "rmsnorm", **fields: Any) -> LayerStats:
    """A layer's statistics: healthy defaults, ``fields`` overriding them."""
    return LayerStats(name=name, kind=kind, **{**HEALTHY, **fields})


def layer(name: str = "blocks.0.norm", kind: Kind = "rmsnorm", eps: float = 1e-6,
          width: int = 64, builtin: bool = False) -> NormLayer:
    """The :class:`NormLayer` that goes with :func:`stats` (a custom norm unless
    ``builtin``: one of torch's own)."""
    return NormLayer(name, kind, eps, (width,), "w", "RMSNorm" if kind == "rmsnorm"
                     else "LayerNorm", builtin=builtin)


def snapshot(step: int, *layers: LayerStats, first_nonfinite: FirstNonfinite | None = None,
             losses: Sequence[tuple[int, float]] = (), first_step: int | None = None
             ) -> Snapshot:
    """A flush ending at ``step`` holding ``layers``."""
    return Snapshot(step, step if first_step is None else first_step,
                    {s.name: s for s in layers}, first_nonfinite, tuple(losses))


def context(snap: Snapshot, config: WatchConfig | None = None,
            probes: Mapping[str, ProbeResult] | None = None,
            history: Mapping[str, Sequence[tuple[int, float]]] | None = None,
            eps: float = 1e-6, builtin: bool = False) -> RuleContext:
    """A rule context for ``snap``: its layers described by :func:`layer`."""
    layers = {name: layer(name, s.kind, eps, builtin=builtin) for name, s in snap.layers.items()}
    return RuleContext(config or WatchConfig(), layers, dict(probes or {}),
                       dict(history or {}))


def exit_now() -> None:
    """End a finished rank without interpreter finalisation: a gloo process that has run
    collectives sometimes aborts there (``terminate called without an active exception``,
    about 1 run in 30 on torch 2.13 after ``destroy_process_group``; pytorch#179291)."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rank(rank: int, worker: Any, *args: Any) -> None:
    worker(rank, *args)
    exit_now()  # only once the rank has written its result; failures still raise


def two_ranks(worker: Any, tmp: Path) -> list[dict[str, Any]]:
    """Run ``worker(rank, world, init_method, out_dir)`` in 2 real gloo processes; each
    writes ``rank<r>.json`` into ``tmp``, returned in rank order."""
    import json

    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(worker, 2, f"file://{tmp / 'store'}", str(tmp)), nprocs=2, join=True)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1)]
