"""What the framework callbacks share: options, flushes, failures (no framework imports).

    >>> config = trainer_config(options, flush_every=50, rank=0, world_size=2, local_rank=0)
    >>> add_trainer_sinks(watch, exchange, log)         # logger metrics; verdicts shared
    >>> on_training_error(watch, exc)                   # post-mortem, hooks removed
    >>> watch.finish()                                  # the end of a run: last steps judged
    >>> watch_optimizers(watch, trainer.optimizers)     # gradient and update norms

Both callbacks validate their options when constructed (:func:`validate`), so bad
configuration fails at setup, never mid-run.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from normwatch.config import WatchConfig
from normwatch.export.crossrank import VerdictExchange
from normwatch.export.metrics import LoggerMetrics
from normwatch.watching import Watch


def validate(options: Mapping[str, Any]) -> dict[str, Any]:
    """Check the watch options now; returns a copy to keep."""
    WatchConfig.from_options(**options)
    return dict(options)


def trainer_config(options: Mapping[str, Any], *, flush_every: int, rank: int,
                   world_size: int, local_rank: int = 0, quiet: bool = False) -> WatchConfig:
    """The watch's config inside a trainer: ``flush_every`` defaults to the trainer's
    logging interval; on several ranks the rank labels reports and metrics, only rank 0
    prints, and each rank on a node serves Prometheus on ``prometheus_port + local_rank``.
    ``quiet``: the trainer draws a live display that console output would tear."""
    merged = dict(options)
    merged.setdefault("flush_every", max(1, int(flush_every)))
    merged.setdefault("rank", rank if world_size > 1 else None)
    if rank != 0:
        merged["report_console"] = False
    elif quiet:
        merged.setdefault("report_console", False)
    if merged.get("prometheus_port") and world_size > 1:
        merged["prometheus_port"] += local_rank
    return WatchConfig.from_options(**merged)


def add_trainer_sinks(watch: Watch, exchange: VerdictExchange,
                      log: Callable[[dict[str, float]], None]) -> None:
    """At each flush: share new verdicts with the other ranks (at regular flushes only,
    which every rank reaches together), then ``log`` the logger metrics, with the
    watch's thresholds."""
    watch.add_sink(exchange)
    watch.add_sink(LoggerMetrics(log, per_layer=watch.config.log_layers, exchange=exchange))


def refused(watch: Watch, what: str) -> None:
    """Say that the checkpoint of ``what`` was not written (``guard=True``)."""
    why = "an incident is open" if watch.court.incidents.open is not None else \
        "the weights hold NaN/inf"
    logging.getLogger(watch.config.logger).warning(
        "[guard] checkpoint of %s not written: %s; the last good checkpoint stays the "
        "latest", what, why)


def on_training_error(watch: Watch | None, exc: BaseException) -> None:
    """Training raised: write the post-mortem, then remove every hook
    (:meth:`Watch.finish`)."""
    if watch is not None:
        watch.finish(exc)


def watch_optimizers(watch: Watch, optimizers: Iterable[object]) -> None:
    """Measure the trainer's optimizers' steps; one that cannot be hooked is skipped
    with a warning (the run goes on, its verdicts without the update side)."""
    for optimizer in optimizers:
        try:
            watch.watch_optimizer(optimizer)
        except Exception as exc:  # never lose the run over a monitor
            warnings.warn(f"normwatch: the optimizer {type(optimizer).__name__} cannot be "
                          f"watched ({exc}); its steps are not measured", RuntimeWarning,
                          stacklevel=3)
