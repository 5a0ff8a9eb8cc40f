"""The guard: a poisoned optimizer step never reaches the weights.

    >>> guard = StepGuard(poisoned, step, max_skips=8)   # watch(..., guard=True) makes it
    >>> guard.attach(optimizer)                           # wraps this optimizer's step

Before each optimizer step the guard asks whether the step is poisoned: a watched norm's
input, output or gradient held NaN/inf in it (the rows the hooks staged this step), or one
of the optimizer's gradients did: the total norm the loop's ``clip_grad_norm_`` returned
for them (:mod:`normwatch.measure.optimizer.clipping`), else one norm of each (NaN/inf
exactly when an element is); its square is the exact gradient norm the update monitor then reports.
Where the device's backend checks a step itself (``backend.check``: on CUDA one Triton
launch reads the step's staged rows and every gradient), it does: a few ops a step,
however many layers and tensors.
On several ranks the flag is reduced (max) over the process group first, so that every
rank takes the same decision. Then:

- an optimizer that takes ``found_inf`` (the fused ones, ``fused=True``: Adam, AdamW, SGD,
  as ``GradScaler`` drives them) steps with it set: on a poisoned step its kernel leaves
  parameters, moments and step counts as they were, and nothing is read on the host;
- any other optimizer: the flag is read (one element: a host sync on an accelerator, free
  on the CPU) and a poisoned step is not called at all.

Either way the parameters and the optimizer state are exactly those of a run that never
took that step. After ``max_skips`` poisoned steps in a row the guard stops skipping (a run
that keeps skipping is broken; skipping forever hides it) and the watch raises a critical
alarm. What it did is resolved at each flush (:meth:`StepGuard.resolve`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from normwatch.guarded import Part
from normwatch.measure.backends import choose
from normwatch.measure.model.sharding import local
from normwatch.measure.optimizer import clipping
from normwatch.measure.optimizer.updates import unwrap
from normwatch.measure.state.rows import dense
from normwatch.measure.step.losses import ride_along
from normwatch.records import GuardEvent

_SUMMED = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
"""Half-precision gradients are summed in fp32 (an fp16 sum overflows at 65504)."""

REASONS = ("a watched norm's input, output or gradient", "the optimizer's gradients")
"""What can poison a step, in the order of :attr:`GuardEvent.reasons`' flags."""


class StepGuard:
    """Wraps optimizers' ``step``; see the module docstring. ``poisoned()`` gives the
    norms' flags of the step under way (0-d bool tensors), ``step()`` its number."""

    def __init__(self, poisoned: Callable[[], list[torch.Tensor]], step: Callable[[], int],
                 max_skips: int,
                 staged: Callable[[], tuple[list[torch.Tensor], list[torch.Tensor]]] | None
                 = None, kernel: str = "auto") -> None:
        self._poisoned = poisoned
        self._staged = staged
        """What ``poisoned()`` reads (the flags of the step's folds so far, its staged
        rows), for a backend that checks them with the gradients in one launch
        (``backend.check``)."""
        self._backend = partial(choose, kernel=kernel)
        self._step = step
        self.max_skips = max_skips
        self._wrapped: weakref.WeakKeyDictionary[Any, Callable[..., Any]] = \
            weakref.WeakKeyDictionary()
        """Optimizers (and scalers) whose ``step`` (``update``) is wrapped, and the wrapper."""
        self._rows: list[tuple[int, torch.device, torch.Tensor]] = []
        """Fused steps not yet resolved: ``(step, device, [norms, gradients, skipped])``."""
        self._in_a_row: dict[torch.device, torch.Tensor] = {}
        """Fused optimizers: poisoned steps in a row, on the device."""
        self._host_in_a_row = 0
        self._resolved = 0
        self.events: list[GuardEvent] = []
        """Every poisoned step so far, resolved (fused steps: at the flush after them)."""
        self._grad_sumsq: weakref.WeakKeyDictionary[
            torch.optim.Optimizer, tuple[int, dict[torch.device, torch.Tensor]]] = \
            weakref.WeakKeyDictionary()
        """Per optimizer, the step last checked and its gradients' sums of squares."""
        self.on_skip: list[Callable[[], None]] = []
        """Called when a step is not called at all (the host path): whoever counts steps
        from the optimizer's own step hooks (``normwatch run``) counts this one too."""
        self.part = Part("guarding the optimizer step", "steps are no longer guarded",
                         off=self.detach)

    def attach(self, optimizer: object) -> None:
        """Guard ``optimizer``'s steps (once; wrappers are unwrapped: the torch optimizer
        inside is the one whose ``step`` every wrapper and ``GradScaler`` call)."""
        inner = unwrap(optimizer)
        if inner in self._wrapped or self.part.failed is not None:
            return
        real = inner.step

        def step(*args: Any, **kwargs: Any) -> Any:
            return self._guarded(inner, real, args, kwargs)

        self._wrapped[inner] = step
        inner.step = step  # type: ignore[method-assign]

    def attach_scaler(self, scaler: Any) -> None:
        """Guard a ``GradScaler``'s ``update`` too: it skips a step with inf/NaN gradients
        itself and lowers its scale, as it should for an fp16 overflow; for a step whose
        norms saw NaN/inf (a bad batch, not the loss scale) the scale and its growth
        tracker are put back as they were (on the device, no read), so the run goes on
        as if it had never seen that batch."""
        real = getattr(scaler, "update", None)
        if real is None or scaler in self._wrapped or self.part.failed is not None:
            return

        def update(*args: Any, **kwargs: Any) -> Any:
            return self._scaler_update(scaler, real, args, kwargs)

        self._wrapped[scaler] = update
        scaler.update = update

    def detach(self) -> None:
        """Give every optimizer its own ``step`` (and scaler its ``update``) back
        (harmless twice)."""
        for owner, wrapper in list(self._wrapped.items()):
            for name in ("step", "update"):
                if vars(owner).get(name) is wrapper:
                    delattr(owner, name)
        self._wrapped.clear()

    def _scaler_update(self, scaler: Any, real: Callable[..., Any], args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Any:
        scale, tracker = getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)
        if self.part.failed is not None or not isinstance(scale, torch.Tensor) or \
                not isinstance(tracker, torch.Tensor):
            return real(*args, **kwargs)
        try:
            norms = _any([f.to(scale.device) for f in self._poisoned()], scale.device)
            saved = scale.clone(), tracker.clone()
        except Exception as exc:  # never take the training run down
            self.part.fail(exc)
            return real(*args, **kwargs)
        out = real(*args, **kwargs)
        try:
            scale.copy_(torch.where(norms, saved[0], scale))
            tracker.copy_(torch.where(norms, saved[1], tracker))
            step = self._step()
            if not any(s == step for s, _, _ in self._rows) and \
                    not any(e.step == step for e in self.events):
                # the scaler skipped this step's optimizer step (its gradients are NaN)
                self._rows.append((step, scale.device, torch.stack(
                    [norms, torch.zeros_like(norms), norms]).double()))
        except Exception as exc:  # never take the training run down
            self.part.fail(exc)
        return out

    def _guarded(self, optimizer: torch.optim.Optimizer, real: Callable[..., Any],
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.part.failed is not None:
            return real(*args, **kwargs)
        try:
            args, kwargs, loss = _run_closure(optimizer, args, kwargs)
            flags = self._flags(optimizer)
            fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and \
                bool(optimizer.defaults.get("fused"))
            if fused:
                return self._fused(optimizer, real, args, kwargs, flags)
            skip = self._decide_on_host(flags)
        except Exception as exc:  # never take the training run down
            self.part.fail(exc)
            return real(*args, **kwargs)
        if not skip:
            return real(*args, **kwargs)
        for hook in self.on_skip:
            hook()
        return loss

    def _flags(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """``[norms poisoned, gradients poisoned]`` (bool, or counts: nonzero where
        poisoned) on the parameters' device, reduced over the ranks. Keeps the gradients'
        exact sum of squares per device for the update monitor (:meth:`grad_sumsq`)."""
        device = next((local(p).device for g in optimizer.param_groups for p in g["params"]),
                      torch.device("cpu"))
        clipped = clipping.take(optimizer)  # the loop's clip_grad_norm_ read them all
        flags = self._checked(optimizer, device, clipped)
        if flags is None:
            flags = self._read(optimizer, device, clipped)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            shared = flags.float()
            dist.all_reduce(shared, op=dist.ReduceOp.MAX)  # one decision on every rank
            flags = shared > 0
        return flags

    def _checked(self, optimizer: torch.optim.Optimizer, device: torch.device,
                 clipped: clipping.Clipped | None) -> torch.Tensor | None:
        """:meth:`_flags` by the backend's check of the staged rows and the gradients
        together (a launch or two, however many tensors); ``None``: not covered (a fold
        earlier in the step, tensors on several devices, a sparse gradient...)."""
        if self._staged is None:
            return None
        earlier, rows = self._staged()
        grads = None if earlier else [] if clipped is not None else \
            _dense_grads(optimizer, device)
        if grads is None:
            return None
        out = self._backend(device).check(rows, grads)
        if out is None:
            return None
        if clipped is None:
            self._grad_sumsq[optimizer] = (self._step(), {device: out[0]})
            return out[1:]  # (counts: nonzero where poisoned)
        if clipped.sumsq is not None:
            self._grad_sumsq[optimizer] = (self._step(), clipped.sumsq)
        return torch.stack([out[1] > 0, ~clipped.finite.to(device)])

    def _read(self, optimizer: torch.optim.Optimizer, device: torch.device,
              clipped: clipping.Clipped | None) -> torch.Tensor:
        """:meth:`_flags` by torch's ops: the norms' flags, the gradients' norms."""
        norms = [f.to(device) for f in self._poisoned()]
        if clipped is not None:
            bad_grads = [(~clipped.finite).to(device)]
            if clipped.sumsq is not None:
                self._grad_sumsq[optimizer] = (self._step(), clipped.sumsq)
        else:
            sumsq = _sumsq(optimizer)
            self._grad_sumsq[optimizer] = (self._step(), sumsq)
            bad_grads = [(~(s < math.inf)).to(device) for s in sumsq.values()]  # (s >= 0)
        return torch.stack([_any(norms, device), _any(bad_grads, device)])

    def grad_sumsq(self, optimizer: torch.optim.Optimizer
                   ) -> dict[torch.device, torch.Tensor] | None:
        """The exact ``|g|²`` (float64, 0-d, per device) of the gradients ``optimizer``
        steps with in the step under way, or ``None`` (not checked this step)."""
        kept = self._grad_sumsq.get(optimizer)
        return kept[1] if kept is not None and kept[0] == self._step() else None

    def _decide_on_host(self, flags: torch.Tensor) -> bool:
        """The one host read: skip this step? (``True``: poisoned and within the bound.)"""
        norms, grads = (bool(v) for v in flags.tolist())
        if not (norms or grads):
            self._host_in_a_row = 0
            return False
        self._host_in_a_row += 1
        skip = self._host_in_a_row <= self.max_skips
        reasons = tuple(r for r, bad in zip(REASONS, (norms, grads), strict=True) if bad)
        self.events.append(GuardEvent(self._step(), reasons, skip))
        return skip

    def _fused(self, optimizer: torch.optim.Optimizer, real: Callable[..., Any],
               args: tuple[Any, ...], kwargs: dict[str, Any], flags: torch.Tensor) -> Any:
        """Step with ``found_inf`` set where the step is poisoned (no host read)."""
        device = flags.device
        bad = flags.any()
        run = self._in_a_row.get(device)
        run = bad.double() if run is None else (run + 1) * bad  # poisoned steps in a row
        self._in_a_row[device] = run
        skip = bad & (run <= self.max_skips)
        self._rows.append((self._step(), device, torch.cat([flags, skip[None]]).double()))
        theirs = getattr(optimizer, "found_inf", None)  # a GradScaler's, for its own skips
        found = skip.float() if theirs is None else torch.maximum(theirs, skip.to(theirs))
        optimizer.found_inf = found  # type: ignore[attr-defined]
        try:
            return real(*args, **kwargs)
        finally:
            if theirs is None:
                del optimizer.found_inf  # type: ignore[attr-defined]
            else:
                optimizer.found_inf = theirs  # type: ignore[attr-defined]

    def tensors(self) -> dict[torch.device, list[torch.Tensor]]:
        """The fused steps' rows, flat per device, to ride along the flush copy."""
        return ride_along(*({device: row} for _, device, row in self._rows))

    def resolve(self, copied: Mapping[torch.device, Iterable[float]]
                ) -> tuple[GuardEvent | None, list[GuardEvent]]:
        """``(the last event resolved before, the poisoned steps since the last flush)``:
        the fused steps' from ``copied`` (the host values of :meth:`tensors`; iterators
        are consumed), the others' as they were decided. Clears the interval."""
        before = self.events[self._resolved - 1] if self._resolved else None
        iters = {d: iter(v) for d, v in copied.items()}
        for step, device, _ in self._rows:
            norms, grads, skipped = (next(iters[device]) > 0 for _ in range(3))
            if norms or grads:
                reasons = tuple(r for r, b in zip(REASONS, (norms, grads), strict=True) if b)
                self.events.append(GuardEvent(step, reasons, skipped))
        self._rows = []
        new, self._resolved = self.events[self._resolved:], len(self.events)
        return before, sorted(new, key=lambda e: e.step)


def _sumsq(optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
    """The exact ``|g|²`` (float64, per device) of ``optimizer``'s gradients: one norm per
    tensor (one call: a fused kernel on accelerators), NaN/inf exactly when an element is
    or when a norm overflows (a gradient past ~1e19 in fp32 poisons the step too)."""
    grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                g = local(p.grad)
                g = g.coalesce().values() if g.is_sparse else g
                grads.setdefault((g.device, g.dtype), []).append(g)
    sumsq: dict[torch.device, torch.Tensor] = {}
    for (where, dtype), gs in grads.items():
        part = torch.stack(torch._foreach_norm(gs, 2, dtype=_SUMMED.get(dtype))) \
            .double().square().sum()
        sumsq[where] = sumsq[where] + part if where in sumsq else part
    return sumsq


def _dense_grads(optimizer: torch.optim.Optimizer, device: torch.device
                 ) -> list[torch.Tensor] | None:
    """The gradients ``optimizer`` steps with, where every one is a plain tensor on
    ``device`` whose elements fill one block of memory (else ``None``)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]
             if p.grad is not None]
    if any(type(g) is not torch.Tensor or g.device != device or g.layout != torch.strided
           or not dense(g) for g in grads):
        return None
    return grads


def _run_closure(optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """A step given a closure (Lightning's automatic optimisation) computes its gradients
    inside ``step``: run the closure first, as the optimizer would, and hand the optimizer
    its result. LBFGS evaluates its closure many times: left as it is (the guard then
    checks only what the step started with)."""
    closure = kwargs.get("closure", args[0] if args else None)
    if closure is None or isinstance(optimizer, torch.optim.LBFGS):
        return args, kwargs, None
    with torch.enable_grad():
        loss = closure()
    rest = {k: v for k, v in kwargs.items() if k != "closure"}
    return (), {**rest, "closure": lambda: loss}, loss


def _any(flags: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Whether any of ``flags`` (0-d bool) is set, on ``device`` (no host read)."""
    if not flags:
        return torch.zeros((), dtype=torch.bool, device=device)
    return torch.stack(flags).any() if len(flags) > 1 else flags[0]
