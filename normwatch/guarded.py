"""The rule for normwatch's code inside a training run: a failure switches that part off
with one warning, and training goes on (a monitor that crashes training is worse than
none).

    >>> part = Part("measuring 'blocks.0.norm'", "this layer is no longer watched",
    ...             off=hook.remove)
    >>> part.fail(exc)        # warns once, calls off(); later failures are silent
    >>> @guarded              # a method whose owner has ``_fail(exc)``: it never raises
    ... def __call__(self, *args): ...
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@functools.cache
def _ours() -> tuple[str, ...]:
    """The folders of normwatch's code: the package and its integrations."""
    spec = importlib.util.find_spec("normwatch.integrations")
    found = list(spec.submodule_search_locations or []) if spec is not None else []
    return tuple(os.path.abspath(p) + os.sep
                 for p in [os.path.dirname(os.path.abspath(__file__)), *found])


class Part:
    """One part of normwatch that a failure disables: ``what`` failed, ``after`` is what
    that means for the run; ``off`` switches the part off (once)."""

    def __init__(self, what: str, after: str, off: Callable[[], None] | None = None) -> None:
        self.what, self.after, self.off = what, after, off
        self.failed: str | None = None
        """Why it failed (``None``: it works)."""

    def fail(self, exc: BaseException) -> None:
        """Switch the part off with one warning; later failures are silent (the hooks
        already registered on this step's tensors may fail again)."""
        if self.failed is not None:
            return
        self.failed = f"{type(exc).__name__}: {exc}"
        if self.off is not None:
            self.off()
        warnings.warn(f"normwatch: {self.what} failed ({self.failed}); {self.after}, "
                      "training continues", RuntimeWarning, stacklevel=outside())

    def run(self, fn: Callable[[], object]) -> None:
        """``fn()`` unless the part failed before; a failure of it fails the part."""
        if self.failed is not None:
            return
        try:
            fn()
        except Exception as exc:  # never take the training run down
            self.fail(exc)


def outside() -> int:
    """The ``stacklevel`` of the first frame outside normwatch (the user's code, or the
    framework's that called a hook) for a warning issued by the caller."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_ours()):
        frame, level = frame.f_back, level + 1
    return level


def guarded(method: F) -> F:
    """``method`` never raises an ``Exception``: it goes to the owner's ``_fail(exc)``
    and the call returns ``None`` (hooks: ``None`` leaves the output as it is)."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:  # never take the training run down
            self._fail(exc)
            return None

    return run  # type: ignore[return-value]
