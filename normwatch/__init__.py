"""normwatch: a numerical-health monitor for the normalization layers of PyTorch models.

    >>> import normwatch
    >>> watch = normwatch.watch(model)      # hooks on every norm layer
    >>> ...                                 # train as usual
    >>> watch.step(loss)                    # after each optimizer step
    >>> watch.alarms                        # what it found

Optional integrations (Lightning, transformers, Prometheus) are imported only where used.
"""

import importlib
import logging
from typing import TYPE_CHECKING, Any

from normwatch._version import __version__

if TYPE_CHECKING:
    from normwatch.config import WatchConfig
    from normwatch.errors import ConfigError, NumericalHealthError
    from normwatch.measure.model.discovery import find_norm_layers, register_norm, unregister_norm
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
    from normwatch.watching import Watch, watch

# Library convention: alarms reach the user's handlers, never Python's last-resort stderr.
logging.getLogger("normwatch").addHandler(logging.NullHandler())

# Loaded on first use (PEP 562): ``normwatch run``'s launcher, which only starts the
# script, never imports torch.
_WHERE = {
    "WatchConfig": "config", "ConfigError": "errors", "NumericalHealthError": "errors",
    "find_norm_layers": "measure.model.discovery", "register_norm": "measure.model.discovery",
    "unregister_norm": "measure.model.discovery", "Alarm": "records", "FirstNonfinite": "records",
    "LayerStats": "records", "Limits": "records", "NormLayer": "records",
    "Snapshot": "records", "Verdict": "records", "ReportError": "report.document",
    "load_report": "report.document", "Watch": "watching", "watch": "watching",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'normwatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"normwatch.{where}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


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
