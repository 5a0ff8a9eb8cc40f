"""Was a model compiled before normwatch attached?

By default ``torch.compile`` does not guard on forward hooks
(``skip_nnmodule_hook_guards``): code compiled without hooks keeps running once they are
added — for the model compiled before :func:`normwatch.watch`, and for any other
instance of its classes (an unwatched copy compiled first hands its hook-free graph to the
watched one): the watch would report zeros. :func:`guard_hooks` turns the hook guards on
for what is compiled from now on; :func:`compiled_code` finds code compiled before (cache
entries on the forward of a module class in the model), which the watch then drops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch import nn

F = TypeVar("F", bound=Callable[..., object])


def eager_frame(fn: F) -> F:
    """Never compile ``fn`` as a frame of its own, nor what it calls: hooks that
    ``torch.compile``'s wrapper runs under Dynamo (the root's hooks, global hooks) would
    otherwise be compiled as tiny graphs guarded on grad mode, recompiling at every eval
    pass. Traced inline (inside a compiled model) they are traced as before."""
    try:
        from torch._dynamo import types as dynamo_types
        from torch._dynamo.eval_frame import set_code_exec_strategy  # type: ignore[attr-defined]

        skip = dynamo_types.FrameAction.SKIP  # type: ignore[attr-defined]
        strategy = dynamo_types.FrameExecStrategy(skip, skip)  # type: ignore[attr-defined]
        set_code_exec_strategy(fn.__code__, strategy)
    except (ImportError, AttributeError):  # another torch: compiled as before
        pass
    return fn


def guard_hooks() -> None:
    """Make compiled code check the hooks it was traced with (process-wide; one cheap
    guard per module with hooks)."""
    import torch._dynamo.config

    torch._dynamo.config.skip_nnmodule_hook_guards = False


def compiled_code(model: nn.Module) -> list[str]:
    """Names of the module classes in ``model`` whose forward has compiled code."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    found = []
    for cls in dict.fromkeys(type(m) for m in model.modules()):
        forward = getattr(cls, "forward", None)
        code = getattr(forward, "__code__", None)
        if code is not None and _debug_get_cache_entry_list(code):
            found.append(cls.__name__)
    return found
