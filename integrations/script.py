"""Watch a script that never heard of normwatch (``normwatch run -- python train.py``).

    >>> session = AutoWatch(WatchConfig(console="lines"))
    >>> session.install()     # global hooks: module calls, optimizer steps, backward()
    ... # the script runs
    >>> session.finish()      # last flush, hooks removed

Models are found as they are called: a global forward pre-hook sees every outermost
module call, and the first one in training mode whose tree holds normalization layers
(the same discovery rules as :func:`normwatch.watch`) gets a watch. Steps are the
optimizer steps (the global optimizer step hook; several optimizers stepping after one
forward count once), each optimizer's gradient and update norms are measured from its
first step; the loss is the scalar a ``backward()`` starts from (kept on its device). If
the script dies of an exception, a post-mortem is written. Options come from
``NORMWATCH_*`` environment variables (:func:`~normwatch.config.options_from_env`).
"""

from __future__ import annotations

import os
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from normwatch.config import WatchConfig, options_from_env
from normwatch.measure.discovery import iter_norm_modules
from normwatch.watch import Watch

from .common import watch_optimizers


class AutoWatch:
    """One process's automatic watch; see the module docstring."""

    def __init__(self, config: WatchConfig) -> None:
        self.config = config
        self.watches: dict[int, Watch] = {}
        self._handles: list[RemovableHandle] = []
        self._depth = 0
        self._forward_since_step = False
        self._loss: torch.Tensor | None = None
        self._skipped: set[int] = set()
        self._real_backward: Callable[..., Any] | None = None
        self._real_excepthook: Callable[..., Any] | None = None

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
        self._real_backward = real = torch.Tensor.backward

        def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if tensor.numel() == 1 and not torch.compiler.is_compiling():
                self._loss = tensor.detach()
            return real(tensor, *args, **kwargs)  # type: ignore[no-untyped-call]

        torch.Tensor.backward = backward  # type: ignore[method-assign, assignment]
        self._real_excepthook = sys.excepthook
        sys.excepthook = self._excepthook

    def _pre(self, module: nn.Module, args: Any) -> None:
        self._depth += 1
        if self._depth != 1:
            return
        self._forward_since_step = True
        key = id(module)
        if key in self.watches or key in self._skipped:
            return
        if not module.training or not any(True for _ in iter_norm_modules(module)):
            self._skipped.add(key)
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "compiled before watch()"
            self.watches[key] = Watch(module, self.config)

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)

    def _stepping(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before an optimizer's first step: every watch measures its steps (the
        optimizer's own hooks run after this global one, from this step on)."""
        for watch in self.watches.values():
            if not watch.closed:
                watch_optimizers(watch, [optimizer])

    def _stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._forward_since_step:
            return  # another optimizer of the same iteration
        self._forward_since_step = False
        for watch in self.watches.values():
            if not watch.closed:
                watch.step(self._loss)
        self._loss = None

    def _excepthook(self, kind: type[BaseException], exc: BaseException,
                    tb: types.TracebackType | None) -> None:
        self.fail(exc)
        if self._real_excepthook is not None:
            self._real_excepthook(kind, exc, tb)

    def fail(self, exc: BaseException) -> None:
        """The script died of ``exc``: a post-mortem per watch, hooks removed."""
        for watch in self.watches.values():
            if not watch.closed:
                try:
                    watch.report_exception(exc)
                finally:
                    watch.close()

    def finish(self) -> None:
        """The script ended: flush what is left, close every watch, remove the hooks."""
        for watch in self.watches.values():
            if not watch.closed:
                if watch.unflushed:
                    watch.flush()
                watch.close()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._real_backward is not None:
            torch.Tensor.backward = self._real_backward  # type: ignore[method-assign]
            self._real_backward = None
        if self._real_excepthook is not None and sys.excepthook == self._excepthook:
            sys.excepthook = self._real_excepthook


def start_from_env() -> AutoWatch:
    """What ``normwatch run`` runs in the script's process: options from the environment,
    console lines by default, finished at exit."""
    import atexit

    options = {"console": "lines", **options_from_env()}
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        options.setdefault("rank", int(os.environ["RANK"]))  # torchrun, Lightning DDP
    session = AutoWatch(WatchConfig.from_options(**options))
    session.install()
    atexit.register(session.finish)
    return session
