"""What a pickled model keeps of its watch: nothing.

    >>> torch.save(model, "model.pt")      # a watched model: its hooks are written as
    >>> torch.load("model.pt", weights_only=False)   # Unwatched ones, which do nothing

torch pickles a module with its hooks. normwatch's hold the watch's whole state (the C++
lane's plans, ctypes tables, the device buffers), which cannot be pickled and means
nothing in another process; each is written as an :class:`Unwatched` hook instead, so a
watched model saves whole and loads unwatched (loading it imports normwatch, as it
imports the model's own classes). A deep copy (``copy.deepcopy``: an EMA copy) is not a
pickle: it copies the hooks as Python would.
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any


class Unwatched:
    """A hook that does nothing: normwatch's hooks in a model loaded from a pickle (a
    bound method of a pickled watcher is this object too)."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Unwatched:
        if name.startswith("__"):
            raise AttributeError(name)
        return self


class PicklesUnwatched:
    """A hook object (or the object a hook is bound to) that a pickle writes as an
    :class:`Unwatched` hook and a deep copy copies as Python would."""

    def __reduce__(self) -> tuple[type[Unwatched], tuple[()]]:
        return Unwatched, ()

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        new = object.__new__(type(self))
        memo[id(self)] = new
        vars(new).update(copy.deepcopy(vars(self), memo))
        return new


class Bound(partial):  # type: ignore[type-arg]
    """``partial(hook, layer)`` (the C++ lane's hook bound to a layer's Python hook) that a
    pickle writes as an :class:`Unwatched` hook."""

    __slots__ = ()

    def __reduce__(self) -> tuple[type[Unwatched], tuple[()]]:
        return Unwatched, ()

    def __deepcopy__(self, memo: dict[int, Any]) -> Bound:
        return type(self)(self.func, *copy.deepcopy(self.args, memo))
