"""normwatch: a numerical-health monitor for the normalization layers of PyTorch models.

    >>> import normwatch
    >>> watch = normwatch.watch(model)      # hooks on every norm layer
    >>> ...                                 # train as usual
    >>> watch.step(loss)                    # after each optimizer step
    >>> watch.alarms                        # what it found
"""

import logging

from normwatch.alarms import Alarm
from normwatch.config import WatchConfig
from normwatch.discovery import NormLayer, find_norm_layers, register_norm, unregister_norm
from normwatch.errors import ConfigError, NumericalHealthError
from normwatch.snapshot import FirstNonfinite, LayerStats, Snapshot
from normwatch.watch import Watch, watch

__version__ = "0.1.0"

# Library convention: alarms reach the user's handlers, never Python's last-resort stderr.
logging.getLogger("normwatch").addHandler(logging.NullHandler())

__all__ = [
    "Alarm",
    "ConfigError",
    "FirstNonfinite",
    "LayerStats",
    "NormLayer",
    "NumericalHealthError",
    "Snapshot",
    "Watch",
    "WatchConfig",
    "__version__",
    "find_norm_layers",
    "register_norm",
    "unregister_norm",
    "watch",
]
