"""What compiled hooks call: two opaque operators whose bodies are the eager recorder's.

Traced inline, a norm call's measurement (row reductions, fold, output check; in the
backward, the gradient folds) added a few dozen small ops at every call site: inductor
generated, compiled and linked code for each (a two-block model took 87 s to compile
watched, 10 s unwatched; six blocks did not finish in 18 minutes), and the ops ran
every step whatever the tier. Here a compiled hook makes one ``torch.library`` call,
``normwatch::observe`` (the call's input and output) or ``normwatch::observe_grad`` (a
gradient), and the compiler sees one extern call per site. At run time its body finds
the layer's compiled path by the address of a tensor that names the layer (a graph input,
the same tensor every step: no per-layer constant reaches the graph, so a block
compiled once serves every layer) and runs what an eager call runs: the flags, counters
and staging are plain Python again, and compiled and eager calls give the same numbers
by construction.

Each call says it writes something, and writes nothing: a forward call its device's
*ticket* (:func:`ticket`: one element), a gradient's call the gradient it reads. So the
calls are never dead code and run in order (the forward's one after another, the
backward's before what comes after them), and the graphs holding them stay cacheable (an
effectful operator, the other way to say it, makes inductor's FX graph cache pass the
graph by: every process compiled the watched model anew, 8.5 s where the unwatched one
loaded in 3.8). A forward call's body that runs inside the backward (an activation
checkpoint's recompute) counts nothing. They are marked unsafe for CUDA graphs (their
bodies run host code every call), so under ``mode="reduce-overhead"`` inductor splits a
graph around them (its graph partitions) and replays the parts between as CUDA graphs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Protocol
from weakref import WeakValueDictionary

import torch


class Owner(Protocol):
    """A layer's compiled path, as the operators call it."""

    call: Callable[[torch.Tensor, torch.Tensor | None, bool], None]
    """Measure one compiled call (input and output detached, ``alone``)."""

    grad: Callable[[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None], None]
    """Measure one gradient of a compiled call (``grad(site, g, x, weight)``: see
    :func:`observe_grad`)."""


_OWNERS: WeakValueDictionary[int, Owner] = WeakValueDictionary()
_TICKETS: dict[torch.device, torch.Tensor] = {}


def own(name: torch.Tensor, owner: Owner) -> None:
    """Make ``owner`` the path the operators call for ``name`` (a tensor naming a layer;
    outside any graph: its device's ticket is made here)."""
    _OWNERS[name.data_ptr()] = owner
    if name.device not in _TICKETS:
        made = _TICKETS[name.device] = torch.zeros(1, device=name.device)
        # the same tensor every call: CUDA graphs take its writes as a buffer's, not as
        # an input's (which would keep the graph from being captured)
        torch._dynamo.mark_static_address(made)


def ticket(name: torch.Tensor) -> torch.Tensor:
    """The ticket of ``name``'s device, which every operator call says it writes."""
    return _TICKETS[name.device]


def disown(name: torch.Tensor, owner: Owner) -> None:
    """Forget ``owner`` for ``name`` (harmless when it is not the owner)."""
    if _OWNERS.get(name.data_ptr()) is owner:
        del _OWNERS[name.data_ptr()]


NAMESPACE = "normwatch::"[:-2]
"""The operators' namespace (written with its ``::``, the way a benchmark renames it to
load another commit's normwatch beside this one: ``tests/benchmarks/compare.py``)."""


def _observe(x: torch.Tensor, y: torch.Tensor | None, name: torch.Tensor,
             order: torch.Tensor, alone: bool) -> None:
    """A compiled norm call: input ``x``, output ``y`` (detached), ``alone``: ``x`` was its
    only tensor input. ``name`` names the layer; ``order`` is its device's ticket. The
    owners are this module's as imported last (imported again, it defines nothing again:
    the operators' bodies, the first import's, find its owners by its name)."""
    owner = getattr(sys.modules.get(__name__), "_OWNERS", _OWNERS).get(name.data_ptr())
    if owner is not None:  # none: the watch closed while compiled code still calls
        owner.call(x, y, alone)


def _observe_grad(g: torch.Tensor, name: torch.Tensor, site: int, x: torch.Tensor | None,
                  weight: torch.Tensor | None) -> None:
    """A gradient of a compiled call at ``site`` (an index of
    :data:`~normwatch.measure.state.rows.SITES`, or its ``WEIGHT``); given the norm's
    input ``x`` (and ``weight``), ``g`` is its output's gradient and the gradient through
    the norm is measured from it too. ``name`` names the layer. It says it writes ``g``
    (it does not): what comes after in the backward then waits for it."""
    owner = getattr(sys.modules.get(__name__), "_OWNERS", _OWNERS).get(name.data_ptr())
    if owner is not None:
        owner.grad(site, g, x, weight)


def _nothing(*args: object) -> None:
    return None


if not hasattr(getattr(torch.ops, NAMESPACE), "observe"):  # (once a process)
    # Defined with the dispatcher's own API, not torch.library.custom_op, whose Python
    # wrappers (autograd, in-place bookkeeping, defaults) cost more than the body they
    # called: 6.3 of 9.6 ms a step for 27 calls, profiled, in a compiled CPU step
    _LIBRARY = torch.library.Library(NAMESPACE, "DEF")  # type: ignore[no-untyped-call]
    _LIBRARY.define(  # type: ignore[no-untyped-call]
        "observe(Tensor x, Tensor? y, Tensor name, Tensor(a!) order, bool alone) -> ()",
        tags=(torch.Tag.cudagraph_unsafe,))
    _LIBRARY.define(  # type: ignore[no-untyped-call]
        "observe_grad(Tensor(a!) g, Tensor name, int site, Tensor? x, Tensor? weight) -> ()",
        tags=(torch.Tag.cudagraph_unsafe,))
    for _name, _body in (("observe", _observe), ("observe_grad", _observe_grad)):
        _LIBRARY.impl(_name, _body, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
        torch.library.register_fake(f"{NAMESPACE}::{_name}", _nothing, lib=_LIBRARY)

observe = getattr(torch.ops, NAMESPACE).observe.default
"""``observe(x, y, name, ticket, alone)``: see :func:`_observe`."""
observe_grad = getattr(torch.ops, NAMESPACE).observe_grad.default
"""``observe_grad(g, name, site, x, weight)``: see :func:`_observe_grad`."""
