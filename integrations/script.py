"""Watch a script that never heard of normwatch (``normwatch run -- python train.py``).

    >>> session = AutoWatch(WatchConfig(console="lines"))
    >>> session.install()     # global hooks: module calls, optimizer steps, backward()
    ... # the script runs
    >>> session.finish()      # last flush, hooks removed

Models are found as they are trained: a global forward pre-hook sees every outermost
module call, and the first training-mode call with grad (whatever eval passes or other
models came before) of a model whose tree holds normalization layers (the same discovery
rules as :func:`normwatch.watch`) gets a watch; wrappers (``torch.compile``, DDP) are
looked through. The hook reads no Python state inside compiled code, so it never makes
Dynamo recompile. A model's steps are the steps of the optimizers that train it (the
global optimizer step hook; several optimizers stepping after one forward of it count
once; an iteration whose step a ``GradScaler`` skipped counts too, as skipped); each
such optimizer's gradient and update norms are measured from its first step. Where
several models train (a GAN's generator and discriminator), each watch steps with its
own optimizers and its own loss; an optimizer that trains no watched model's parameters
steps the watches of frozen models (an input being optimized through one). The loss is
the scalar a ``backward()`` starts from, unscaled when a ``GradScaler`` scaled it (kept on
its device). If the script dies of an exception, a post-mortem is written. Options come
from ``NORMWATCH_*`` environment variables (:func:`~normwatch.config.options_from_env`).
"""

from __future__ import annotations

import os
import sys
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from normwatch.config import WatchConfig, options_from_env
from normwatch.measure.layer.compiling import eager_frame
from normwatch.measure.model.discovery import iter_norm_modules
from normwatch.measure.model.isolation import internal
from normwatch.measure.optimizer import clipping
from normwatch.watching import Watch

from .common import watch_optimizers


class AutoWatch:
    """One process's automatic watch; see the module docstring."""

    def __init__(self, config: WatchConfig) -> None:
        self.config = config
        self.watches: dict[int, Watch] = {}
        self._models: dict[int, weakref.ref[nn.Module]] = {}
        """Each watch's model, by its key in :attr:`watches`."""
        self.skipped_steps = 0
        """Iterations whose optimizer step a ``GradScaler`` skipped (inf/NaN gradients)."""
        self._handles: list[RemovableHandle] = []
        self._depth = 0
        self._forwarded: set[int] = set()
        """The watches (by their key in :attr:`watches`) whose model ran a training
        forward since its last step."""
        self._owners: weakref.WeakKeyDictionary[object, tuple[int, set[int]]] = \
            weakref.WeakKeyDictionary()
        """Per optimizer, the watches it trains (:meth:`_trained`), with the number of
        watches when that was decided."""
        self._optimizer_steps = 0
        self._loss: torch.Tensor | None = None
        self._scaled: tuple[weakref.ref[torch.Tensor], torch.Tensor] | None = None
        self._ignored: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._patched: list[tuple[object, str, Any]] = []
        self._real_excepthook: Callable[..., Any] | None = None
        self._clipping: clipping.Handle | None = None

    def install(self) -> None:
        """Register the global hooks (once)."""
        if self._handles:
            return
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self._handles = [register_module_forward_pre_hook(self._pre),
                         register_module_forward_hook(self._post, always_call=True),
                         register_optimizer_step_pre_hook(self._stepping),
                         register_optimizer_step_post_hook(self._stepped)]
        real_backward = torch.Tensor.backward

        def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if tensor.numel() == 1 and not torch.compiler.is_compiling():
                self._loss = self._unscaled(tensor)
            return real_backward(tensor, *args, **kwargs)  # type: ignore[no-untyped-call]

        self._patch(torch.Tensor, "backward", backward)
        scaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
        if scaler is not None:
            real_scale, real_step = scaler.scale, scaler.step

            def scale(grad_scaler: Any, outputs: Any) -> Any:
                scaled = real_scale(grad_scaler, outputs)
                if isinstance(outputs, torch.Tensor) and outputs.numel() == 1 and \
                        isinstance(scaled, torch.Tensor):
                    self._scaled = (weakref.ref(scaled), outputs.detach())
                    for watch in list(self.watches.values()):
                        if not watch.closed:
                            watch.watch_scaler(grad_scaler)
                return scaled

            def step(grad_scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
                before = self._optimizer_steps
                out = real_step(grad_scaler, optimizer, *args, **kwargs)
                if self._optimizer_steps == before:  # inf/NaN gradients: step skipped
                    self.skipped_steps += 1
                    self._step(self._trained(optimizer), skipped=True)
                return out

            self._patch(scaler, "scale", scale)
            self._patch(scaler, "step", step)
        self._real_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        # before the script imports clip_grad_norm_ by name: the guard and the update
        # monitor take the norm it computes instead of reading the gradients again
        self._clipping = clipping.install()

    def _patch(self, owner: object, name: str, value: Any) -> None:
        self._patched.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, value)

    def _unscaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss a ``backward()`` starts from, before a ``GradScaler`` scaled it."""
        scaled = self._scaled
        if scaled is not None and scaled[0]() is loss:
            return scaled[1]
        return loss.detach()

    @eager_frame
    def _pre(self, module: nn.Module, args: Any) -> None:
        # Compiled code never reads this hook's Python state (no guard, no recompile);
        # normwatch's own calls of a module (probes) are not the script's.
        if torch.compiler.is_compiling() or internal():
            return
        self._depth += 1
        if self._depth != 1 or not (module.training and torch.is_grad_enabled()):
            return  # eval and no-grad passes neither attach nor count: nothing is skipped
        model = unwrap(module)
        key = id(model)
        if key in self.watches:
            self._forwarded.add(key)
            return
        if model in self._ignored:
            return
        self._ignored.add(model)  # decided once, whatever follows
        if not any(True for _ in iter_norm_modules(model, self.config.include,
                                                   self.config.exclude)):
            return
        try:
            watch = self.watches[key] = Watch(model, self.config, drop_compiled=False)
            self._models[key] = weakref.ref(model)
            self._forwarded.add(key)
            if watch.guard is not None:  # a step it keeps from the weights still counts
                watch.guard.on_skip.append(lambda: self._kept_from_weights(key))
        except Exception as exc:  # already watched by the script, a bad report dir, ...:
            # the script trains on, unwatched, rather than dies
            print(f"normwatch run: not watching {type(model).__name__}: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr)

    @eager_frame
    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or internal():
            return
        self._depth = max(0, self._depth - 1)

    def _stepping(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before an optimizer's step: the watches it trains measure its steps (the
        optimizer's own hooks run after this global one, from this step on)."""
        for key in self._trained(optimizer):
            watch = self.watches[key]
            if not watch.closed:
                watch_optimizers(watch, [optimizer])

    def _stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizer_steps += 1
        self._step(self._trained(optimizer), skipped=False)

    def _kept_from_weights(self, key: int) -> None:
        """The guard of watch ``key`` kept a poisoned step from the weights: a step."""
        self._optimizer_steps += 1
        self._step({key}, skipped=False)

    def _trained(self, optimizer: object) -> set[int]:
        """The watches whose model has a parameter ``optimizer`` trains; none: those whose
        model is frozen (an input being optimized through it), not those another optimizer
        trains (an actor-critic's critic without norms). Decided again when a watch is
        added."""
        known = self._owners.get(optimizer)
        if known is None or known[0] != len(self.watches):
            params = {id(p) for group in getattr(optimizer, "param_groups", ())
                      for p in group.get("params", ())}
            owners = {key for key, model in self._models.items()
                      if any(id(p) in params for p in _parameters(model()))}
            if not owners:  # it trains something else: an input, or a model without norms
                owners = {key for key, model in self._models.items()
                          if not any(p.requires_grad for p in _parameters(model()))}
            known = (len(self.watches), owners)
            self._owners[optimizer] = known
        return known[1]

    def _step(self, keys: set[int], skipped: bool) -> None:
        """The watches ``keys`` whose model trained since their last step end a step, with
        the last loss (several optimizers stepping after one forward count once)."""
        stepped = False
        for key in keys & self._forwarded:
            self._forwarded.discard(key)
            watch = self.watches[key]
            if not watch.closed:
                watch.step(self._loss, skipped=skipped)
                stepped = True
        if stepped:
            self._loss = None
            self._scaled = None

    def _excepthook(self, kind: type[BaseException], exc: BaseException,
                    tb: types.TracebackType | None) -> None:
        self.fail(exc)
        if self._real_excepthook is not None:
            self._real_excepthook(kind, exc, tb)

    def fail(self, exc: BaseException) -> None:
        """The script died of ``exc``: a post-mortem per watch, hooks removed."""
        for watch in list(self.watches.values()):
            watch.finish(exc)

    def finish(self) -> None:
        """The script ended: flush what is left, close every watch, remove the hooks."""
        for watch in list(self.watches.values()):
            watch.finish()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._clipping is not None:
            self._clipping.remove()
            self._clipping = None
        for owner, name, value in reversed(self._patched):
            setattr(owner, name, value)
        self._patched = []
        if self._real_excepthook is not None and sys.excepthook == self._excepthook:
            sys.excepthook = self._real_excepthook


def _parameters(model: nn.Module | None) -> list[nn.Parameter]:
    return [] if model is None else list(model.parameters())


def unwrap(module: nn.Module) -> nn.Module:
    """The model inside the wrappers a script calls it through (``torch.compile``'s
    ``OptimizedModule``, DDP, ``DataParallel``): one watch, whichever is called."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while True:
        inner = getattr(module, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            module = inner
        elif isinstance(module, DistributedDataParallel | DataParallel):
            module = module.module
        else:
            return module


def start_from_env() -> AutoWatch:
    """What ``normwatch run`` runs in the script's process: options from the environment,
    console lines by default (rank 0 only under torchrun), finished at exit."""
    import atexit

    options = {"console": "lines", **options_from_env()}
    rank = int(os.environ.get("RANK", "0") or 0)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        options.setdefault("rank", rank)  # torchrun, Lightning DDP
        if rank != 0:  # one voice: the other ranks still measure and write their reports
            options.update(console=None, report_console=False)
    session = AutoWatch(WatchConfig.from_options(**options))
    # the global hooks fire once more for torch.compile's wrapper: seen and set aside
    warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there "
                            "are global hooks", category=UserWarning)
    session.install()
    atexit.register(session.finish)
    return session
