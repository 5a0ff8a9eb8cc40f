"""normwatch's own calls of a user's module (the fp16 probe, behaviour and eps tests),
isolated from the run they watch.

    >>> with isolated(device):
    ...     out = hookless_copy(module)(crafted)

Inside :func:`isolated` no global module hook runs (the user's, or ``normwatch run``'s),
no autograd graph is recorded and the global RNG streams (CPU, and ``device``'s) are put
back as they were; :func:`hookless_copy` copies a module without any of its hooks, so
no user hook sees a crafted input and no buffer of the real module (BatchNorm's running
statistics) changes. Global hooks are suspended process-wide while the block runs: it
is meant for a few small calls between training steps, on the training thread.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.modules.module as module_globals
from torch import nn

_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks",
                 "_global_forward_hooks_always_called", "_global_forward_hooks_with_kwargs",
                 "_global_backward_pre_hooks", "_global_backward_hooks")
_MODULE_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
                 "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
                 "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")

_depth = 0


def internal() -> bool:
    """Whether an :func:`isolated` block is running (global hooks of normwatch's own
    check this too, for hooks registered inside the block)."""
    return _depth > 0


@contextmanager
def isolated(device: torch.device | None = None) -> Iterator[None]:
    """Run normwatch's own module calls: no global hooks, no grad, RNG state restored."""
    global _depth
    saved = {name: getattr(module_globals, name) for name in _GLOBAL_HOOKS}
    cuda = [device.index or 0] if device is not None and device.type == "cuda" else []
    _depth += 1
    try:
        for name, hooks in saved.items():
            setattr(module_globals, name, type(hooks)())
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            yield
    finally:
        _depth -= 1
        for name, hooks in saved.items():
            setattr(module_globals, name, hooks)


def hookless_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose modules carry no hooks (the hooks, and whatever
    they reference, are not copied at all)."""
    memo: dict[int, Any] = {}
    for sub in module.modules():
        for name in _MODULE_HOOKS:
            hooks = sub.__dict__.get(name)
            if hooks is not None:
                memo[id(hooks)] = type(hooks)() if isinstance(hooks, dict) else OrderedDict()
    return copy.deepcopy(module, memo)
