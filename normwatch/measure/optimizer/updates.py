"""The update side of a step: gradient and parameter-update norms from optimizer hooks.

    >>> monitor = UpdateMonitor(step=lambda: watch.step_count + 1)
    >>> monitor.attach(optimizer)            # step pre/post hooks on that optimizer
    ... # optimizer.step() records one device row: [|g|², |Δp|², |p|²]
    >>> updates = monitor.resolve(copied)    # at the flush: (UpdateStats, ...)

The pre-hook copies a fixed sample of each trainable parameter: every
:data:`SAMPLE_STRIDE`-th block of :data:`BLOCK` elements (37, prime: it walks across the
columns of any power-of-two width instead of always reading the same ones), tensors
smaller than :data:`EXACT_BELOW` whole; the samples are views made once per parameter
list, packed per device and dtype end to end into one buffer by one copy
(:class:`Pack`). The post-hook copies the same sample after the step into a second
buffer and subtracts it from the first (the change), then refills the first with the
same sample of the gradients the step used (one view per gradient, made from the
parameter's layout), and reduces each buffer with one norm, every tensor scaled by its
elements per sampled element (an estimate of each sum of squares where the values are
spread like the tensor; the relative error of a norm is about ``sqrt(SAMPLE_STRIDE / (2
n))`` for ``n`` elements of similar size: 0.4 % at 1M elements): a few ops per step
whatever the number of tensors, reading 1/37 of the parameters (twice) and gradients.
``|p|`` is reduced from the second buffer on full-tier steps only (it moves slowly, and
is carried to the steps between). Where the guard already read every gradient before
the step (``exact``), its exact gradient norm is taken instead of the sample's.
A non-finite gradient element outside the sample is not seen here (the norms' gradient
hooks and the loss see it). The two buffers cost 2/37 of the optimizer's local
parameters (a shard under FSDP2) in memory: for the duration of ``step()`` on
accelerators, kept between steps on the CPU (:data:`KEEP_ON`). A device's backend may
sample its own way (``backend.sample``, one kept buffer of 1/37: on the CPU one C call per
dtype, with the hooks' checks around it in C++, ``backend.sampler``; on CUDA one Triton
launch per dtype and hook); :class:`Pack` is torch's.
Everything stays on the parameters' devices (no host sync) until the flush copies the
rows along with the statistics. Several optimizers stepping in one training step add up
into one row. A failure in a hook detaches the monitor with one warning; training goes
on.
"""

from __future__ import annotations

import math
import operator
import weakref
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from itertools import chain
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from normwatch.errors import ConfigError
from normwatch.guarded import Part, guarded
from normwatch.measure.backends import choose
from normwatch.measure.model.sharding import local
from normwatch.measure.state.backend import Backend, Sample
from normwatch.measure.state.rows import dense, runs, summed_dtype
from normwatch.measure.step.losses import ride_along
from normwatch.records import UpdateStats

KEEP_ON = frozenset({"cpu"})
"""Device types whose sample buffers are kept between steps (:meth:`Pack.release`)."""
WIDTH = 3
"""Values per device row: gradient, update and parameter sums of squares."""
SAMPLE_STRIDE = 37
"""The update is measured on every 37th block of a tensor (2.7 %: two buffers of it, the
values before and after the step, stay under 1/16 of the parameters)."""
BLOCK = 16
"""Elements per sampled block (64 bytes of fp32: one cache line, so the sample reads 1/37
of the memory too)."""
EXACT_BELOW = 8 * SAMPLE_STRIDE * BLOCK
"""Tensors with fewer elements are copied whole (a sample of under 8 blocks says little)."""


def sample(t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` the norms are measured on, in memory order: every
    :data:`SAMPLE_STRIDE`-th block of :data:`BLOCK` (the last partial block left out), or
    all of them; a view, no copy, where ``t`` is :func:`dense` (else a flat copy: a
    snapshot of its values, to be taken again for new ones)."""
    n = t.numel()
    if not dense(t):
        return t.reshape(-1)
    if n < EXACT_BELOW:
        return t.view(-1) if t.is_contiguous() else t.as_strided((n,), (1,))
    blocks = -(-(n // BLOCK) // SAMPLE_STRIDE)
    return t.as_strided((blocks, BLOCK), (SAMPLE_STRIDE * BLOCK, 1))


def unwrap(optimizer: object) -> torch.optim.Optimizer:
    """The torch optimizer inside wrappers, or a clear error. A wrapper may itself
    subclass ``Optimizer`` without being one (Accelerate's steps the one it holds)."""
    inner = optimizer
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer  # type: ignore[attr-defined]
    if not isinstance(inner, torch.optim.Optimizer):
        raise ConfigError("'optimizer' must be a torch.optim.Optimizer (or a wrapper with an "
                          f"'optimizer' attribute holding one): got {type(optimizer).__name__}")
    return inner


BEFORE, AFTER = 0, 1
"""A :class:`Pack`'s two slots: the samples before the step (then the change, then the
gradients), and after it."""


class Pack:
    """The samples of one device and dtype laid end to end (one op to fill a slot, one to
    reduce it, whatever the number of tensors), in two slots (:data:`BEFORE`,
    :data:`AFTER`): the sampled tensors' blocks as ``(rows, BLOCK)``, the small tensors
    flat; each block row weighted by its tensor's elements per sampled element (the small
    ones are whole: weight 1). Its ops on the parameters run without grad (the optimizer's
    hooks run in the loop's grad mode; the C pack's path needs no such context). A
    backend's own sample (:class:`~normwatch.measure.state.backend.Sample`) is used the
    same way: :meth:`store`, then :meth:`measure`."""

    def __init__(self, samples: list[torch.Tensor], scales: list[float]) -> None:
        self.layouts = [(s.shape, s.stride()) for s in samples]
        """Each sample's size and strides (what samples a gradient laid out like it)."""
        self.blocked = [i for i, s in enumerate(samples) if s.dim() == 2]
        self.flat = [i for i, s in enumerate(samples) if s.dim() != 2]
        first = samples[0]
        self.device = first.device
        self.keep = first.device.type in KEEP_ON
        """Whether the buffers are kept between steps (else made for each step)."""
        counts = [samples[i].shape[0] for i in self.blocked]
        self.summed = summed_dtype(first.dtype)
        self.weights: torch.Tensor | None = None
        """Half precision: the row weights (float64), applied to per-row sums in fp32."""
        self.roots: torch.Tensor | None = None
        """Full precision: the square roots of the row weights, ``(rows, 1)``, to scale the
        buffer by in place (no per-row vector of sums is ever allocated)."""
        if self.blocked and self.summed is None:
            self.roots = runs([math.sqrt(scales[i]) for i in self.blocked], counts,
                              first.dtype, first.device)[:, None]
        elif self.blocked:
            self.weights = runs([scales[i] for i in self.blocked], counts, torch.float64,
                                first.device)
        self.buffers: list[tuple[torch.Tensor | None, torch.Tensor | None]] = [(None, None)] * 2
        """Per slot: the blocked and the flat buffer (``None``: none made, or released)."""

    @torch.no_grad()
    def fill(self, tensors: list[torch.Tensor], slot: int) -> None:
        """Copy ``tensors`` (laid out like the samples) into ``slot``'s buffers, made on the
        first fill (or after :meth:`release`)."""
        parts = []
        for index, buffer in zip((self.blocked, self.flat), self.buffers[slot], strict=True):
            picked = [tensors[i] for i in index]
            parts.append(None if not picked else torch.cat(picked) if buffer is None
                         else torch.cat(picked, out=buffer))
        self.buffers[slot] = (parts[0], parts[1])

    def copy(self, source: int, slot: int) -> None:
        """Copy slot ``source``'s buffers into ``slot``'s (both filled)."""
        for into, values in zip(self.buffers[slot], self.buffers[source], strict=True):
            if into is not None and values is not None:
                into.copy_(values)

    def subtract(self) -> None:
        """:data:`BEFORE` minus :data:`AFTER`, in place: the change, negated."""
        for before, after in zip(*self.buffers, strict=True):
            if before is not None and after is not None:
                before.sub_(after)

    def sumsq(self, slot: int) -> torch.Tensor:
        """``slot``'s weighted float64 sum of squares (0-d, on its device); full precision
        buffers are scaled in place on the way (refill before reuse)."""
        blocked, flat = self.buffers[slot]
        norms = []
        if blocked is not None and self.roots is not None:
            norms.append(torch.linalg.vector_norm(blocked.mul_(self.roots)))
        elif blocked is not None and self.weights is not None:  # half: per row, in fp32
            rows = torch.linalg.vector_norm(blocked, dim=1, dtype=self.summed)
            norms.append((rows.double().square() @ self.weights).sqrt())
        if flat is not None:
            norms.append(torch.linalg.vector_norm(flat, dtype=self.summed))
        if not norms:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        both = norms[0] if len(norms) == 1 else torch.stack([n.double() for n in norms])
        return both.double().square().sum()

    def store(self, values: list[torch.Tensor], unchanged: bool) -> None:
        """Keep the samples' ``values`` before the step; ``unchanged``: nothing wrote the
        parameters since the last step's :meth:`measure` read them."""
        if unchanged and self.keep:  # the last step's values after: nothing wrote since
            self.buffers.reverse()
        else:
            self.fill(values, BEFORE)

    @torch.no_grad()
    def measure(self, after: list[torch.Tensor], grads: list[torch.Tensor] | None,
                size: bool) -> torch.Tensor:
        """``[|g|², |Δp|², |p|²]`` (float64, on the device) from :data:`BEFORE` and the
        samples ``after`` the step: ``|p|²`` only with ``size`` (else 0; :data:`AFTER`
        stays as the next step's values before), ``|g|²`` from the gradients ``grads``
        (each laid out like its parameter; ``None``: 0); then :meth:`release`."""
        if grads is not None:
            grads = [g.as_strided(*layout) for g, layout in zip(grads, self.layouts,
                                                                 strict=True)]
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        self.fill(after, AFTER)
        self.subtract()  # BEFORE: -Δp
        change, norm, grad = self.sumsq(BEFORE), zero, zero
        if size:
            self.copy(AFTER, BEFORE)
            norm = self.sumsq(BEFORE)
        if grads is not None:
            self.fill(grads, BEFORE)
            grad = self.sumsq(BEFORE)
        self.release()
        return torch.stack([grad, change, norm])

    def release(self) -> None:
        """Drop the buffers unless they are kept between steps."""
        if not self.keep:
            self.buffers = [(None, None)] * 2


class _Sampled:
    """An optimizer's trainable parameters as last seen: their samples (views), each
    tensor's elements per sampled element, and per device and dtype the sample the sums
    are taken on (its backend's, else a :class:`Pack`); ``backend(device)``: a device's
    backend."""

    def __init__(self, params: list[torch.Tensor],
                 backend: Callable[[torch.device], Backend]) -> None:
        self.params = params
        self.addresses = [p.data_ptr() for p in params]
        self.versions: int | None = None
        """The sum of the parameters' versions when last copied into :data:`AFTER` (see
        :meth:`unchanged`)."""
        self.samples = [sample(local(p).detach()) for p in params]
        self.copied = [i for i, p in enumerate(params) if not dense(local(p))]
        """Parameters whose samples are copies (not :func:`dense`): taken again for each
        fill (:meth:`current`)."""
        self.scales = [_scale(local(p), s) for p, s in zip(params, self.samples, strict=True)]
        self.layouts = [(s.shape, s.stride(), local(p).shape, local(p).stride(), s.dtype)
                        for p, s in zip(params, self.samples, strict=True)]
        """Per parameter, what a gradient laid out like it is sampled by: the sample's
        size and strides, the (local) parameter's shape, strides and dtype."""
        self.strides = [layout[3] for layout in self.layouts]
        self.dtypes = [layout[4] for layout in self.layouts]
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, s in enumerate(self.samples):
            groups.setdefault((s.device, s.dtype), []).append(i)
        self.packs: list[tuple[list[int], Sample]] = []
        for index in groups.values():
            samples, scales = [self.samples[i] for i in index], [self.scales[i] for i in index]
            device = samples[0].device
            made = None if self.copied else backend(device).sample(samples, scales)
            self.packs.append((index, made or Pack(samples, scales)))
        self.kept = any(pack.keep for _, pack in self.packs)
        """Whether some buffers are kept between steps (then the versions are noted)."""
        self.lane: Any = backend(params[0].device).sampler(params, self.packs) \
            if params else None
        """The step hooks' work in native code, where every sample is the backend's (then
        the versions are the lane's)."""

    def before(self, groups: list[dict[str, Any]]) -> None:
        """Keep the samples' values before the step (``groups``: the optimizer's param
        groups, whose trained parameters these are)."""
        if self.lane is not None and self.lane.before(groups):
            return
        unchanged = self.kept and self.unchanged()
        for index, pack in self.packs:
            pack.store(self.current(index), unchanged)

    def seen(self) -> None:
        """The parameters were just copied into :data:`AFTER`: note their versions."""
        if self.lane is not None:
            self.lane.seen()
        else:
            self.versions = sum(map(_version, self.params))

    def unchanged(self) -> bool:
        """Whether no parameter was written since :meth:`seen` (once: the next call says
        ``False`` until :meth:`seen` again). In-place writes bump a tensor's version (and
        versions only grow: an equal sum is every version equal); a write through
        ``.data`` bypasses it (and is not seen)."""
        versions, self.versions = self.versions, None
        return versions is not None and versions == sum(map(_version, self.params))

    def fits(self, params: list[torch.Tensor]) -> bool:
        """Whether ``params`` are these, in place (no parameter replaced or re-allocated)."""
        return len(params) == len(self.params) and all(map(operator.is_, params, self.params)) \
            and list(map(torch.Tensor.data_ptr, params)) == self.addresses

    def current(self, index: list[int]) -> list[torch.Tensor]:
        """The samples of the parameters ``index`` names, copies taken again."""
        if not self.copied:  # (C's getter: no Python a tensor, each step)
            return list(map(self.samples.__getitem__, index))
        return [sample(local(self.params[i]).detach()) if i in self.copied else
                self.samples[i] for i in index]

    def grads_alike(self) -> list[torch.Tensor] | None:
        """Every (local) gradient, or ``None`` unless every one is laid out like its dense
        parameter (same strides and dtype, not sparse): then the parameters' samples
        sample them too (the hot path: no per-tensor arithmetic). A plain tensor's gradient
        has its shape (torch refuses any other): a shard's is asked."""
        if self.copied:
            return None
        grads = list(map(_grad, self.params))
        if set(map(type, grads)) == _PLAIN and list(map(_dtype, grads)) == self.dtypes \
                and set(map(_layout, grads)) == _STRIDED \
                and list(map(torch.Tensor.stride, grads)) == self.strides:
            return grads  # (each checked at once in C, not in a loop: a loop of Python
            # inside the step costs several times what it costs warm)
        out = []
        plain, strided = torch.Tensor, torch.strided
        for g, (_, _, shape, strides, dtype) in zip(grads, self.layouts, strict=True):
            if g is None:
                return None
            if type(g) is not plain:  # a DTensor's: its shard
                g = local(g)
                if g.shape != shape:
                    return None
            if g.dtype != dtype or g.layout != strided or g.stride() != strides:
                return None
            out.append(g)
        return out


_trained, _params = operator.attrgetter("requires_grad"), operator.itemgetter("params")
_version = operator.attrgetter("_version")
"""A tensor's version counter (bumped by each in-place write)."""
_grad, _dtype, _layout = (operator.attrgetter(a) for a in ("grad", "dtype", "layout"))
_PLAIN, _STRIDED = {torch.Tensor}, {torch.strided}


def _scale(t: torch.Tensor, s: torch.Tensor) -> float:
    """Elements of ``t`` per element of its sample ``s``."""
    return t.numel() / s.numel() if s.numel() else 1.0


class UpdateMonitor:
    """Per-step gradient and update norms of the attached optimizers; see the module
    docstring. ``step()`` gives the number of the training step being taken."""

    def __init__(self, step: Callable[[], int], full: Callable[[], bool] = lambda: True,
                 exact: Callable[[torch.optim.Optimizer],
                                 Mapping[torch.device, torch.Tensor] | None] | None = None,
                 kernel: str = "auto") -> None:
        self._step = step
        self._backend = partial(choose, kernel=kernel)
        """Each device's backend (``kernel=``'s), which may sample its own way."""
        self._full = full
        """Whether the step under way measures every statistic (then ``|p|²`` too)."""
        self._exact = exact
        """The exact ``|g|²`` per device of an optimizer's step under way, where someone
        (the guard) already read every gradient: then the sample's is not taken."""
        self._handles: list[RemovableHandle] = []
        self._attached: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._sampled: dict[int, _Sampled] = {}
        self._pending: set[int] = set()
        """Optimizers whose step is under way (the pre-hook filled their buffers)."""
        self._rows: list[tuple[int, int, torch.device, torch.Tensor, bool]] = []
        """``(step, optimizer id, device, [|g|², |Δp|², |p|²], whether |p|² was measured)``."""
        self._sizes: dict[int, float] = {}
        """Per optimizer, its last measured ``|p|²`` (carried to the steps between)."""
        self._lrs: dict[int, float | None] = {}
        self.part = Part("measuring the optimizer step",
                         "gradient and update norms are no longer recorded", off=self._off)

    def attach(self, optimizer: object) -> None:
        """Hook ``optimizer`` (once; wrappers are unwrapped)."""
        inner = unwrap(optimizer)
        if inner in self._attached or self.part.failed is not None:
            return
        self._attached.add(inner)
        self._handles += [inner.register_step_pre_hook(self._pre),
                          inner.register_step_post_hook(self._post)]

    @guarded
    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        sampled = self._sampled.get(id(optimizer))
        groups = optimizer.param_groups
        if sampled is None or sampled.lane is None or not sampled.lane.before(groups):
            params = list(filter(_trained, chain.from_iterable(map(_params, groups))))
            # (in C, not a loop of Python: inside the step each line costs many times more)
            if sampled is None or not sampled.fits(params):
                sampled = self._sampled[id(optimizer)] = _Sampled(params, self._backend)
            sampled.before(groups)
        self._pending.add(id(optimizer))

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        sampled = self._sampled.get(id(optimizer))
        if id(optimizer) not in self._pending or sampled is None:
            return
        self._pending.discard(id(optimizer))
        self._measure(optimizer, sampled)

    @guarded
    def _measure(self, optimizer: torch.optim.Optimizer, sampled: _Sampled) -> None:
        """The step's rows: ``|g|²``, ``|Δp|²`` and (full-tier steps) ``|p|²`` of the
        samples, per device."""
        exact = None if self._exact is None else self._exact(optimizer)
        sized = self._full() or id(optimizer) not in self._sizes
        lane = None if exact is not None else sampled.lane
        row = None if lane is None else lane.measure(sized)
        rows = self._python_rows(sampled, exact, sized) if row is None else {row.device: row}
        step = self._step()
        for device, row in rows.items():
            self._rows.append((step, id(optimizer), device, row, sized))
        lrs = [g["lr"] for g in optimizer.param_groups]
        lr = max(lrs) if lrs and all(isinstance(v, float | int) for v in lrs) else None
        old = self._lrs.get(step)
        self._lrs[step] = lr if old is None or lr is None else max(old, lr)
        if sized:
            self._sizes.setdefault(id(optimizer), math.nan)

    def _python_rows(self, sampled: _Sampled,
                     exact: Mapping[torch.device, torch.Tensor] | None,
                     sized: bool) -> dict[torch.device, torch.Tensor]:
        """The step's rows per device by the packs' own Python (see :meth:`_measure`)."""
        rows: dict[torch.device, torch.Tensor] = {}
        # the gradients are read after the step: a closure (LBFGS, Lightning) computes
        # them inside step(), after the pre-hook
        grads = sampled.grads_alike() if exact is None else None
        for index, pack in sampled.packs:
            row = pack.measure(sampled.current(index), None if grads is None else
                               list(map(grads.__getitem__, index)), sized)
            if grads is None and exact is None:  # missing or sparse: one norm per tensor
                row[0] = _grad_sumsq([sampled.params[i].grad for i in index], pack.device)
            rows[pack.device] = rows[pack.device] + row if pack.device in rows else row
        for device, g in (exact or {}).items():  # the guard's exact |g|²
            if device in rows:
                rows[device][0] = g
            else:
                rows[device] = torch.stack([g, *[torch.zeros_like(g)] * 2])
        if sampled.kept:
            sampled.seen()
        return rows

    def tensors(self) -> dict[torch.device, list[torch.Tensor]]:
        """This interval's rows, flat per device, to ride along the flush copy."""
        return ride_along(*({device: row} for _, _, device, row, _ in self._rows))

    def resolve(self, copied: Mapping[torch.device, Iterable[float]]) -> tuple[UpdateStats, ...]:
        """One :class:`UpdateStats` per step from ``copied`` (the host values of
        :meth:`tensors`, per device; iterators are consumed), then forget the interval.
        A step that did not measure ``|p|²`` reports the optimizer's last measured one."""
        iters = {d: iter(v) for d, v in copied.items()}
        steps: dict[int, dict[int, list[float]]] = {}
        """Per step, per optimizer: ``[|g|², |Δp|², |p|² or NaN where not measured]``."""
        for step, owner, device, _, sized in self._rows:
            g, u, p = (next(iters[device]) for _ in range(WIDTH))
            total = steps.setdefault(step, {}).setdefault(owner, [0.0, 0.0, 0.0])
            total[:] = [total[0] + g, total[1] + u, total[2] + p if sized else math.nan]
        out = []
        for step, owners in sorted(steps.items()):
            for owner, (_, _, p) in owners.items():  # |p|² carried to the steps between
                self._sizes[owner] = self._sizes.get(owner, math.nan) if math.isnan(p) else p
            g = sum(v[0] for v in owners.values())
            u = sum(v[1] for v in owners.values())
            p = sum(self._sizes[owner] for owner in owners)
            out.append(UpdateStats(step, g**0.5, u**0.5, p**0.5, self._lrs.get(step)))
        self._rows.clear()
        self._lrs.clear()
        return tuple(out)

    def _fail(self, exc: Exception) -> None:
        self.part.fail(exc)

    def _off(self) -> None:
        self._pending.clear()
        self.detach()

    def detach(self) -> None:
        """Remove the hooks and drop the kept copies (harmless twice)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._sampled.clear()


@torch.no_grad()
def _grad_sumsq(grads: list[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """``|g|²`` estimated tensor by tensor, for gradients not laid out like their
    parameters (missing, sparse), on ``device``: one norm call per dtype, each sample's
    norm scaled by the square root of its tensor's elements per sampled element."""
    by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, float]]] = {}
    for g in grads:
        if g is not None:
            values = _values(local(g))
            s = sample(values)
            by_dtype.setdefault(s.dtype, []).append((s, math.sqrt(_scale(values, s))))
    total = torch.zeros((), dtype=torch.float64, device=device)
    for dtype, group in by_dtype.items():
        norms = torch._foreach_norm([s for s, _ in group], 2, dtype=summed_dtype(dtype))
        scaled = torch._foreach_mul(norms, [root for _, root in group])
        total = total + torch.stack(scaled).double().square().sum()
    return total


def _values(t: torch.Tensor) -> torch.Tensor:
    """``t``, or for a sparse gradient (an embedding's) its stored values."""
    return t.coalesce().values() if t.is_sparse else t
