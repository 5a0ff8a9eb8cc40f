"""The toy model and ``normwatch demo``."""
