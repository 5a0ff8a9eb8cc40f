"""normwatch: a numerical-health monitor for the normalization layers of PyTorch models.

    >>> import normwatch
    >>> watch = normwatch.watch(model)      # hooks on every norm layer
    >>> ...                                 # train as usual
    >>> watch.step(loss)                    # after each optimizer step
    >>> watch.alarms                        # what it found

Optional integrations (Lightning, transformers, Prometheus) are imported only where used.
"""

import logging

from normwatch._version import __version__
from normwatch.config import WatchConfig
from normwatch.errors import ConfigError, NumericalHealthError
from normwatch.measure.discovery import find_norm_layers, register_norm, unregister_norm
from normwatch.records import (
    Alarm,
    FirstNonfinite,
    LayerStats,
    Limits,
    NormLayer,
    Snapshot,
    Verdict,
)
from normwatch.report.document import ReportError, load_report
from normwatch.watch import Watch, watch

# Library convention: alarms reach the user's handlers, never Python's last-resort stderr.
logging.getLogger("normwatch").addHandler(logging.NullHandler())

__all__ = [
    "Alarm",
    "ConfigError",
    "FirstNonfinite",
    "LayerStats",
    "Limits",
    "NormLayer",
    "NumericalHealthError",
    "ReportError",
    "Snapshot",
    "Verdict",
    "Watch",
    "WatchConfig",
    "__version__",
    "find_norm_layers",
    "load_report",
    "register_norm",
    "unregister_norm",
    "watch",
]
