"""What compiled hooks call: two opaque operators whose bodies are the eager recorder's.

Traced inline, a norm call's measurement (row reductions, fold, output check; in the
backward, the gradient folds) added a few dozen small ops at every call site: inductor
generated, compiled and linked code for each (a two-block model took 87 s to compile
watched, 10 s unwatched; six blocks did not finish in 18 minutes), and the ops ran
every step whatever the tier. Here a compiled hook makes one ``torch.library`` call,
``normwatch::observe`` (the call's input and output) or ``normwatch::observe_grad`` (a
gradient), and the compiler sees one extern call per site. At run time its body finds
the layer's compiled path by the address of the layer's accumulator row (a graph input,
the same tensor every step: no per-layer constant reaches the graph, so a block
compiled once serves every layer) and runs what an eager call runs: the flags, counters
and staging are plain Python again, and compiled and eager calls give the same numbers
by construction.

The operators are *effectful* (ordered, never dead-code eliminated; a forward call's body
that runs inside the backward, an activation checkpoint's recompute, counts nothing) and
mutate nothing the graph sees; they are marked unsafe for CUDA graphs (their bodies run
Python), so ``mode="reduce-overhead"`` leaves the graph holding them to run without CUDA
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

    def compiled_grad(self, at: str, g: torch.Tensor, x: torch.Tensor | None,
                      weight: torch.Tensor | None) -> None:
        """Measure one gradient of a compiled call (see :func:`observe_grad`)."""


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


@torch.library.custom_op("normwatch::observe_grad", mutates_args=(), tags=_TAGS)
def observe_grad(g: torch.Tensor, row: torch.Tensor, at: str, x: torch.Tensor | None,
                 weight: torch.Tensor | None) -> None:
    """A gradient of a compiled call at site ``at``; given the norm's input ``x`` (and
    ``weight``), ``g`` is its output's gradient and the gradient through the norm is
    measured from it too. ``row`` names the layer."""
    owner = _OWNERS.get(row.data_ptr())
    if owner is not None:
        owner.compiled_grad(at, g, x, weight)


@observe_grad.register_fake
def _(g: torch.Tensor, row: torch.Tensor, at: str, x: torch.Tensor | None,
      weight: torch.Tensor | None) -> None:
    return None


for _name in ("normwatch::observe", "normwatch::observe_grad"):
    torch.library._register_effectful_op(_name, EffectType.ORDERED)
