"""Gradients through one norm: what arrives at its output, what it passes back, and the
hidden state's gradient where it reads it; and its weight's gradient.

    >>> hooks = GradHooks(rows, backend, target, stage, fail)  # one per norm layer
    >>> hooks.watch_call(x, y)        # forward hook, eager
    >>> hooks.measure(site, g, x, w)  # a compiled gradient's operator, at run time

Hooks registered in the forward (on full-tier steps) fire in the backward with
``dL/dy`` (``grad_out``, a pre-hook on the node that made the output: what a tensor hook
is, without its Python bookkeeping), ``dL/dx`` through the norm only (``grad_in``: hooks
on the autograd nodes of the norm's own graph that feed ``x``, their parts summed,
:func:`through_nodes`; or, where autograd keeps ``x`` anyway, computed from ``dL/dy``,
``x`` and the weight by the output's pre-hook, :meth:`GradHooks.computes`) and ``dL/dx``
in total (``grad_hidden``, a pre-hook on the node that made the input itself: the
residual stream of a pre-norm block). None of them puts a node into the model's graph,
so the order in which autograd sums the hidden state's gradient, and every trained bit,
stays as unwatched. Eager hooks have their device's backend read each into its tokens'
L2 norms and its min and max (``backend.grad_rows``: torch's two reductions, or on the
CPU one pass of the C kernel, which also adds two parts of ``grad_in`` as it reads them)
and stage them; the accumulator folds every staged gradient at once when the step ends
(:mod:`~normwatch.measure.state.grad_fold`). Compiled code puts tensor hooks on the
output and the input instead (:mod:`~normwatch.measure.layer.compiled`); one opaque
operator (``normwatch::observe_grad``, :mod:`~normwatch.measure.layer.operators`) hands
each gradient to :meth:`GradHooks.measure`, which measures it and, from the output's,
the gradient through the norm (:func:`through_formula`) as eager hooks do. No host
sync. Hooks live on the step's autograd graph and go with it: no tensor is kept past
the step.

The weight's gradient is measured by a hook on the parameter, registered for the steps
whose backward is measured (:meth:`GradHooks.arm`, between steps): it fires with each
backward's local gradient, before DDP reduces it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from normwatch.guarded import guarded
from normwatch.measure.backends.native.contract import MAX_NODES
from normwatch.measure.backends.native.lane import GradLane, WeightHandle
from normwatch.measure.backends.native.readers import PLAIN
from normwatch.measure.layer.operators import observe_grad
from normwatch.measure.model.sharding import local
from normwatch.measure.state.backend import Backend
from normwatch.measure.state.rows import HIDDEN, IN, OUT, WEIGHT, LayerRows

Target = Callable[[], "torch.Tensor | None"]
Stage = Callable[[int, "tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]", int],
                 None]
"""Stages a layer's gradient: ``(site index, (norms, lo, hi), width)`` (see
:class:`GradRows`)."""


_saved_hooks = torch._C._autograd._top_saved_tensors_default_hooks
"""The innermost saved-tensor hooks in force (``None``: none; a checkpoint's drop what
autograd saves)."""



def through_nodes(y: torch.Tensor, x: torch.Tensor) -> list[tuple[Any, int]]:
    """The autograd nodes between a norm's output ``y`` and its input ``x`` that feed ``x``
    directly, each with the index of its edge into ``x`` (one node for a fused norm,
    several for a hand-written one). Empty when ``y`` has no graph or the walk leaves the
    norm (nodes made before ``x`` are outside it), or more than :data:`~normwatch.measure.
    backends.native.contract.MAX_NODES` are walked. (``grads.cpp``'s ``through_nodes``
    walks alike.)"""
    start, target = y.grad_fn, x.grad_fn
    if start is None:
        return []
    floor = target._sequence_nr() if target is not None else -1
    found: list[tuple[Any, int]] = []
    stack, seen = [start], {id(start)}
    while stack:
        node = stack.pop()
        for k, (nxt, nr) in enumerate(node.next_functions):
            if nxt is None:
                continue
            if target is not None and nxt is target:
                if nr == x.output_nr:
                    found.append((node, k))
                continue
            if hasattr(nxt, "variable"):  # a leaf: x itself, or a parameter
                if nxt.variable is x:
                    found.append((node, k))
                continue
            if id(nxt) in seen or nxt._sequence_nr() < floor:
                continue
            seen.add(id(nxt))
            if len(seen) > MAX_NODES:
                return []
            stack.append(nxt)
    return found


class _Through:
    """Gathers the parts of ``dL/dx`` the norm's nodes send to ``x`` (post-hooks on those
    nodes, which read gradients and change none: :meth:`watch` places them, each called
    with its node's edge ``k`` into ``x`` first), then hands them on once (their sum is
    ``dL/dx`` through the norm). The C++ gradient hooks gather in C++ and make one for
    compiled autograd (:meth:`GradHooks._gather`)."""

    __slots__ = ("_hook", "_left", "_parts")

    def __init__(self, count: int, hook: Callable[[list[torch.Tensor]], None]) -> None:
        self._hook, self._left = hook, count
        self._parts: list[torch.Tensor] = []

    def watch(self, nodes: Sequence[tuple[Any, int]]) -> None:
        for node, k in nodes:
            node.register_hook(partial(self, k))

    def __call__(self, k: int, grad_inputs: Sequence[torch.Tensor | None], _: object) -> None:
        g = grad_inputs[k]
        self._left -= 1
        if g is not None:
            self._parts.append(g.detach() if g.requires_grad else g)
        if self._left == 0 and self._parts:
            parts, self._parts = self._parts, []
            self._hook(parts)


Through = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""``(dL/dy tokens, x tokens, weight or None) -> dL/dx`` through the norm (float32)."""


def through_formula(kind: str, eps: float, one_plus_w: bool) -> Through | None:
    """The gradient through a layer or RMS norm from its output's gradient, its input and
    its weight (tokens ``(n, D)``, weight ``(D,)``), for compiled code, which cannot hook
    the norm's own autograd nodes and must not put a node in front of its input (that
    re-associates the hidden state's gradient sum). ``None`` for other kinds.

    RMSNorm ``y = w·x·r``, ``r = 1/√(mean x² + ε)``: ``dx = r·(w g) − x r³ mean(x·w g)``;
    LayerNorm ``y = w·x̂``, ``x̂ = (x − μ)·r``: ``dx = r·(w g − mean(w g) − x̂ mean(w g·x̂))``.
    """
    if kind not in ("layernorm", "rmsnorm"):
        return None

    def through(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        g, x = g.float(), x.float()
        if weight is not None:
            w = weight.float().reshape(1, -1)
            g = g * (w + 1.0 if one_plus_w else w)
        if kind == "rmsnorm":
            r = torch.rsqrt(x.square().mean(1, keepdim=True) + eps)
            return r * g - x * r.pow(3) * (x * g).mean(1, keepdim=True)
        xc = x - x.mean(1, keepdim=True)
        r = torch.rsqrt(xc.square().mean(1, keepdim=True) + eps)
        xhat = xc * r
        return r * (g - g.mean(1, keepdim=True) - xhat * (g * xhat).mean(1, keepdim=True))

    return through


class GradHooks:
    """The gradient side of one layer's hook (see the module docstring).

    ``rows``: the layer's (what the backends read with), ``backend(device)`` the backend
    of a device; ``target()`` gives the row naming the layer to the compiled operators,
    or ``None`` while nothing is measured (eager: this step is not measured); ``stage``
    takes an eager hook's rows; ``fail`` disables the layer on an exception (eager only:
    a traced hook must not touch Python state). ``computable``: the gradient through the
    norm may be computed from its output's (:meth:`computes`; given with ``through``).
    """

    def __init__(self, rows: LayerRows, backend: Callable[[torch.device], Backend],
                 target: Target, stage: Stage, fail: Callable[[Exception], None],
                 through: Through | None = None, computable: bool = False,
                 lane: Callable[[GradHooks], GradLane | None] | None = None,
                 toggled: set[GradHooks] | None = None) -> None:
        self.rows = rows
        self.tokens = rows.tokens
        self.backend = backend
        self.width = rows.width
        """Elements per token when the last dim holds one (read as it is), else ``None``."""
        self.through = through
        """Compiled code: the gradient through the norm from its output's
        (:func:`through_formula`; ``None``: not measured compiled)."""
        self._target = target
        self._stage = stage
        self._fail = fail
        self._weight: torch.Tensor | None = None
        self._weight_handle: RemovableHandle | WeightHandle | None = None
        self._armed = True
        """What the last :meth:`arm` said: whether that step's backward is measured (said
        at each change while the weight's hook is Python's; a C++ hook, on whatever the
        step, is not told again)."""
        self._toggled = set() if toggled is None else toggled
        """Where these hooks are while the weight's hook is Python's (armed on measured
        steps alone: a Python hook that fires only to return costs ~40 µs inside a
        backward); a C++ one stays armed and returns at once on other steps."""
        self._first = {site: partial(self._node, site, 0) for site in (OUT, HIDDEN)}
        """The pre-hooks of nodes whose first output is the tensor watched."""
        self._computed = computable
        """Whether the gradient through the norm may be computed from its output's
        (:meth:`computes`)."""
        self._lane = None if lane is None else lane(self)
        """These hooks in C++ (:class:`~normwatch.measure.backends.native.lane.GradLane`: the same
        reads with no Python frame, this object's methods for the other cases), or
        ``None``: the Python hooks."""

    def watch_call(self, x: torch.Tensor, y: torch.Tensor, alone: bool = False,
                   weight: object = None) -> None:
        """Eager: hook one call's gradients (input ``x``, output ``y``) without touching
        the model's graph: pre-hooks on the nodes that made ``y`` and ``x`` (what a tensor
        hook is, without its Python bookkeeping: ~4 µs warm each, several times that in a
        training step), node hooks for the part through the norm; ``alone``: ``x`` was
        the call's only tensor input (and ``weight`` the norm's weight): where it
        :meth:`computes` the part through the norm, the output's hook computes it too."""
        if not x.requires_grad:
            return self._before(y, OUT)
        if not isinstance(x, nn.Parameter):  # a leaf that lives on keeps its hooks
            self._before(x, HIDDEN)
        node = y.grad_fn
        if alone and node is not None and self.computes(x, y, weight):
            if self._lane is not None:
                self._lane.out(y, x, weight)
            else:
                node.register_prehook(partial(self._both, y.output_nr,
                                              [x, weight, x._version]))
            return
        self._before(y, OUT)
        nodes = through_nodes(y, x)
        if nodes and (self._lane is None or not self._lane.through(nodes)):
            _Through(len(nodes), self._in).watch(nodes)

    def computes(self, x: torch.Tensor, y: torch.Tensor, weight: object) -> bool:
        """Whether the gradient through the norm is computed from its output's, its input
        and ``weight`` (:func:`through_formula`, in C: one hook, no walk over the norm's
        nodes), not read from its nodes: a layer or RMS norm of a plain float32 input and
        output alike on the CPU, where autograd keeps ``x`` for the norm's backward anyway (no
        checkpoint's saved-tensor hooks: they drop it), ``weight`` (or none) one per
        element of a token."""
        return self._computed and y.dtype == torch.float32 \
            and y.shape == x.shape and x.shape[-1] == self.width \
            and _saved_hooks(False) is None \
            and self.backend(x.device).covers_through(self.rows, x, weight)

    def _both(self, k: int, box: list[Any], grads: Sequence[torch.Tensor | None]) -> None:
        """The output's node's pre-hook: its gradient ``k`` and, from it and ``box``'s
        input and weight (:meth:`computes` took them; let go here), the gradient through
        the norm; not through it where the input was written in place since the forward."""
        g = grads[k]
        if not box or g is None:
            return
        x, weight, version = box
        box.clear()
        try:  # (guarded in place, as _measure; the common case in few frames)
            if torch.compiler.is_compiling():  # compiled autograd: measured by the operator
                # (no version check: one Dynamo cannot trace, and the norm's backward,
                # which saved x, refuses an x written in place anyway)
                return self._traced(OUT, g, x=x.detach(),
                                    weight=None if weight is None else weight.detach())
            if not g.numel() or self._target() is None:
                return
            t = g.detach() if g.requires_grad else g
            if x._version != version:
                return self._measure(OUT, t)
            self._out_through(t, x, weight,
                              self.backend(t.device).through_rows(self.rows, t, x, weight))
        except Exception as exc:  # never take the training run down
            self._fail(exc)

    def _out_through(self, g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                     rows: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Stage the output's gradient ``g`` and the gradient through the norm computed
        from it (:func:`through_formula`): ``rows``, the C kernel's, or (``None``) by
        torch's ops."""
        if rows is None:
            self._measure(OUT, g)
            return self._through(self.through, g, x.detach(),  # type: ignore[arg-type]
                                 None if weight is None else weight.detach())
        self._stage(OUT, (rows[0], None, None), g.shape[-1])
        self._stage(IN, (rows[1], None, None), g.shape[-1])

    def _before(self, t: torch.Tensor, site: int) -> None:
        """Measure ``t``'s gradient at ``site`` when the node that made ``t`` is about to
        run (a leaf, which has none: a tensor hook)."""
        node = t.grad_fn
        if node is None:
            t.register_hook(self._out if site == OUT else self._hidden)  # type: ignore[no-untyped-call]
        elif self._lane is not None:
            self._lane.site(t, site)
        else:
            node.register_prehook(self._first[site] if t.output_nr == 0 else
                                  partial(self._node, site, t.output_nr))

    def _node(self, site: int, k: int, grads: Sequence[torch.Tensor | None]) -> None:
        """A node's pre-hook: its output ``k``'s gradient (``None``: it got none)."""
        g = grads[k]
        if g is not None:
            self._measure(site, g)

    def watch_weight(self, weight: object) -> None:
        """Hook the layer's weight once (again when the module's weight is replaced, as
        FSDP2 does with the unsharded parameter)."""
        if weight is self._weight or not isinstance(weight, torch.Tensor) \
                or not weight.requires_grad:
            return
        self.remove()
        self._weight = weight
        if self._cpp(weight) is None:
            self._toggled.add(self)
        self.arm(self._armed)

    def _cpp(self, weight: torch.Tensor) -> GradLane | None:
        """The C++ lane that hooks ``weight`` (``None``: a Python hook does)."""
        return self._lane if type(weight) in PLAIN else None

    def arm(self, on: bool) -> None:
        """Register the weight's hook (``on``: this step's backward is measured) or take a
        Python one off until the next measured step (between steps: no recompile, the
        hooks of a leaf are run outside compiled graphs); a C++ one stays."""
        self._armed = on
        weight = self._weight
        if weight is None:
            return
        cpp = self._cpp(weight)
        if self._weight_handle is None and (on or cpp is not None):
            self._weight_handle = cpp.weight(weight) if cpp is not None else \
                weight.register_hook(self._weight_grad)  # type: ignore[no-untyped-call]
        elif not on and cpp is None and self._weight_handle is not None:
            self._weight_handle.remove()
            self._weight_handle = None

    def remove(self) -> None:
        """Remove the weight's hook (the activation hooks go with their graphs)."""
        if self._weight_handle is not None:
            self._weight_handle.remove()
            self._weight_handle = None
        self._weight = None
        self._toggled.discard(self)

    def close(self) -> None:
        """Remove the weight's hook; hooks still on live graphs measure nothing more."""
        self.remove()
        if self._lane is not None:
            self._lane.close()

    def _out(self, g: torch.Tensor) -> None:
        self._measure(OUT, g)

    def _in(self, parts: list[torch.Tensor]) -> None:
        self._measure(IN, *parts)

    def _gather(self, count: int) -> _Through:
        """A gatherer of the parts of ``count`` nodes for :meth:`_in` (compiled autograd's,
        in the place of the C++ gradient hooks' own)."""
        return _Through(count, self._in)

    def _hidden(self, g: torch.Tensor) -> None:
        self._measure(HIDDEN, g)

    def measure(self, site: int, g: torch.Tensor, x: torch.Tensor | None = None,
                weight: torch.Tensor | None = None) -> None:
        """Measure gradient ``g`` at ``site`` (what a compiled gradient's operator runs);
        given the norm's input ``x`` (and ``weight``), ``g`` is the output's gradient and
        the gradient through the norm (:func:`through_formula`) is measured too. Nothing
        when this backward is not measured."""
        if self._target() is None:
            return
        if site == WEIGHT:
            return self._weight_grad(g)
        if x is not None and self.through is not None and site == OUT:
            backend = self.backend(g.device)
            self._out_through(g, x, weight, backend.through_rows(self.rows, g, x, weight)
                              if x.shape[-1] == self.width
                              and backend.covers_through(self.rows, x, weight) else None)
        else:
            self._measure(site, g)

    @guarded
    def _through(self, through: Through, g: torch.Tensor, x: torch.Tensor,
                 weight: torch.Tensor | None) -> None:
        self._measure(IN, through(self.tokens(g.detach()), self.tokens(x), weight))

    def _measure(self, site: int, g: torch.Tensor, *parts: torch.Tensor) -> None:
        """Stage ``g`` (plus ``parts``, detached: the rest of a gradient that came in
        parts)."""
        # guarded as @guarded does, in place, and the common case in few frames: inside a
        # backward each frame costs several µs, and a full step runs four of these a norm
        try:
            if torch.compiler.is_compiling():  # traced (compiled autograd, a leaf's hook)
                return self._traced(site, g, *parts)
            if not g.numel() or self._target() is None:
                return
            t = self._view(g.detach() if g.requires_grad else g)  # (create_graph=True)
            part = self._view(parts[0]) if len(parts) == 1 else None
            if len(parts) > 1:
                for more in parts:  # (as autograd would have summed them)
                    t = t + self._view(more)
            # a second part is added as the gradient is read (one pass, in C on the CPU)
            self._stage(site, self.backend(t.device).grad_rows(self.rows, site, t, part),
                        t.shape[-1])
        except Exception as exc:  # never take the training run down
            self._fail(exc)

    def _traced(self, site: int, g: torch.Tensor, *parts: torch.Tensor,
                x: torch.Tensor | None = None, weight: torch.Tensor | None = None) -> None:
        """A hook as Dynamo traces it (compiled autograd traces the backward's hooks): the
        gradient handed to the compiled operator, whose body measures it at run time
        (:meth:`measure`). No Python state is written here: Dynamo replays such writes
        after the graph, over what the operators staged while it ran. A gradient that
        came in parts is added in the graph, in float32 as the kernels add them."""
        row = self._target()
        if row is None:
            return
        if parts:
            wide = torch.promote_types(g.dtype, torch.float32)
            g = g.to(wide)
            for part in parts:
                g = g + part.to(wide)
        observe_grad(g, row, site, x, weight)

    def _view(self, g: torch.Tensor) -> torch.Tensor:
        """``g`` as tokens: as it is where its last dim holds one."""
        return g if g.shape[-1] == self.width else self.tokens(g)

    @guarded
    def _weight_grad(self, g: torch.Tensor) -> None:
        if torch.compiler.is_compiling():  # (compiled autograd)
            return self._traced(WEIGHT, g)
        if g is not None and self._target() is not None:
            g = local(g)
            g = g.detach() if g.requires_grad else g
            self._stage(WEIGHT, self.backend(g.device).grad_rows(self.rows, WEIGHT, g, None), 1)
