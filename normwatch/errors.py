"""Exceptions raised by normwatch."""

from __future__ import annotations

from collections.abc import Sequence

from normwatch.records import Alarm


class ConfigError(ValueError):
    """A watch option or argument is invalid; the message names it."""


class NumericalHealthError(RuntimeError):
    """Raised (only when asked, via ``raise_on``) when alarms reach a severity.

    ``error.alarms`` holds the alarms that triggered it.
    """

    def __init__(self, alarms: Sequence[Alarm]) -> None:
        self.alarms = tuple(alarms)
        lines = [f"{len(self.alarms)} numerical-health alarm(s):"]
        lines += [f"  [{a.severity}] {a.message}" for a in self.alarms]
        super().__init__("\n".join(lines))
