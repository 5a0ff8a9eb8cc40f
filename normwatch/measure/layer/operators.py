"""What compiled hooks call: an opaque operator whose body is the eager recorder's, and a
note taken while tracing.

Traced inline, a norm call's measurement (row reductions, fold, output check; in the
backward, the gradient folds) added a few dozen small ops at every call site: inductor
generated, compiled and linked code for each (a two-block model took 87 s to compile
watched, 10 s unwatched; six blocks did not finish in 18 minutes), and the ops ran
every step whatever the tier. Here a compiled forward hook makes one ``torch.library``
call, ``normwatch::observe`` (the call's input and output), and the compiler sees one
extern call per site. (The gradients fold in the graph, by plain ops the backward fuses:
:mod:`~normwatch.measure.layer.gradients`; :func:`note_traced_grads` tells the
accumulator so while tracing.) At run time its body finds
the layer's compiled path by the address of the layer's accumulator row (a graph input,
the same tensor every step: no per-layer constant reaches the graph, so a block
compiled once serves every layer) and runs what an eager call runs: the flags, counters
and staging are plain Python again, and compiled and eager calls give the same numbers
by construction.

The operator is *effectful* (ordered, never dead-code eliminated; a forward call's body
that runs inside the backward, an activation checkpoint's recompute, counts nothing) and
mutates nothing the graph sees; it is marked unsafe for CUDA graphs (its body runs
Python), so ``mode="reduce-overhead"`` leaves the graph holding it to run without CUDA
graphs.
"""

from __future__ import annotations

from typing import Protocol
from weakref import WeakValueDictionary

import torch
from torch._library.effects import EffectType


class Owner(Protocol):
    """A layer's compiled path, as the operators call it."""

    def compiled_call(self, x: torch.Tensor, y: torch.Tensor | None, alone: bool) -> None:
        """Measure one compiled call (input and output detached)."""


_OWNERS: WeakValueDictionary[int, Owner] = WeakValueDictionary()


def own(row: torch.Tensor, owner: Owner) -> None:
    """Make ``owner`` the path the operators call for ``row`` (a layer's accumulator row)."""
    _OWNERS[row.data_ptr()] = owner


def disown(row: torch.Tensor, owner: Owner) -> None:
    """Forget ``owner`` for ``row`` (harmless when it is not the owner)."""
    if _OWNERS.get(row.data_ptr()) is owner:
        del _OWNERS[row.data_ptr()]


_TAGS = (torch.Tag.cudagraph_unsafe,)


@torch.library.custom_op("normwatch::observe", mutates_args=(), tags=_TAGS)
def observe(x: torch.Tensor, y: torch.Tensor | None, row: torch.Tensor, alone: bool) -> None:
    """A compiled norm call: input ``x``, output ``y`` (detached), ``alone``: ``x`` was its
    only tensor input. ``row`` names the layer."""
    owner = _OWNERS.get(row.data_ptr())
    if owner is not None:  # none: the watch closed while compiled code still calls
        owner.compiled_call(x, y, alone)


@observe.register_fake
def _(x: torch.Tensor, y: torch.Tensor | None, row: torch.Tensor, alone: bool) -> None:
    return None


torch.library._register_effectful_op("normwatch::observe", EffectType.ORDERED)


class Noted(Protocol):
    """What compiled code folds gradients for (an accumulator)."""

    def traced_now(self) -> None:
        """A graph that folds gradients was traced (run while tracing)."""


_NOTED: WeakValueDictionary[int, Noted] = WeakValueDictionary()


def noted(target: Noted) -> int:
    """The key :func:`note_traced_grads` takes for ``target``."""
    _NOTED[id(target)] = target
    return id(target)


@torch.compiler.assume_constant_result  # type: ignore[untyped-decorator]
def note_traced_grads(key: int) -> int:
    """While tracing (run by the compiler, then gone from the graph): graphs now fold
    gradients for the target of ``key`` (:func:`noted`)."""
    target = _NOTED.get(key)
    if target is not None:
        target.traced_now()
    return key
