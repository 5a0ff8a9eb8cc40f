"""normwatch and ``torch.compile``: code compiled before the watch, and a Dynamo bug its
hooks would trip (:func:`keep_traced_writes`).

By default ``torch.compile`` does not guard on forward hooks
(``skip_nnmodule_hook_guards``): code compiled without hooks keeps running once they are
added — for the model compiled before :func:`normwatch.watch`, and for any other
instance of its classes (an unwatched copy compiled first hands its hook-free graph to the
watched one): the watch would report zeros. :func:`guard_hooks` turns the hook guards on
for what is compiled from now on and notes the cache entries compiled before;
:func:`compiled_code` finds those still on the forward of a module class in the model,
which the watch then drops. Code compiled since checks the hooks it was traced with, so a
second model of a class compiled after a first watch (a notebook's cell run again, a
sweep's next trial) needs no reset: its watch neither warns nor drops the other models'
code.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from types import CodeType
from typing import Any, TypeVar

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


_UNGUARDED: weakref.WeakValueDictionary[int, CodeType] = weakref.WeakValueDictionary()
"""The compiled code of the cache entries made while the hook guards were off, by its id
(code objects compare by value; an entry's code dies with the entry, at a reset, and
leaves this table then)."""


def guard_hooks() -> None:
    """Make compiled code check the hooks it was traced with (process-wide; one cheap
    guard per module with hooks), noting the cache entries compiled without that check."""
    import torch._dynamo.config

    codes = _input_codes()
    if torch._dynamo.config.skip_nnmodule_hook_guards and codes is not None:
        for code in filter(None, (ref() for ref in codes.seen)):
            _UNGUARDED.update((id(e.code), e.code) for e in _entries(code))
    torch._dynamo.config.skip_nnmodule_hook_guards = False


def keep_traced_writes() -> None:
    """Mend torch's Dynamo (2.13) so that a traced hook on an intermediate tensor loses
    none of the program's attribute writes (process-wide; once).

    Dynamo traces such a hook (normwatch's on the hidden state) in a speculation that
    ends by replacing the trace's side-effect table with a copy; the tracker of an
    object's ``__dict__`` made before keeps writing to the table it was made with. A write
    to that object after the hook is then lost: the compiled program reads the old value
    and leaves it on the object (eager reads the new one). Found through ``transformers``
    5.25, whose attention sets a flag before and reads it after (a graph break there; a
    silently different result elsewhere). The tracker now reads the table current."""
    try:
        from torch._dynamo.variables.dicts import SideEffectsProxyDict
    except ImportError:  # another torch: as it was
        return
    if "side_effects" in vars(SideEffectsProxyDict):  # mended, or torch keeps it current
        return

    def current(self: Any) -> Any:
        table = vars(self)["_table"]
        graph = getattr(table, "output_graph_weakref", lambda: None)()
        return table if graph is None else graph.side_effects

    def made_with(self: Any, table: Any) -> None:
        vars(self)["_table"] = table

    setattr(SideEffectsProxyDict, "side_effects", property(current, made_with))  # noqa: B010


def compiled_code(model: nn.Module) -> list[str]:
    """Names of the module classes in ``model`` whose forward has code compiled without
    the hook guards (:func:`guard_hooks`)."""
    known = _input_codes() is not None  # (else every entry counts, as before the guards)
    found = []
    for cls in dict.fromkeys(type(m) for m in model.modules()):
        code = getattr(getattr(cls, "forward", None), "__code__", None)
        if code is not None and any(not known or id(e.code) in _UNGUARDED
                                    for e in _entries(code)):
            found.append(cls.__name__)
    return found


def _entries(code: CodeType) -> list[Any]:
    """The cache entries of ``code`` (Dynamo's)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return list(_debug_get_cache_entry_list(code))


def _input_codes() -> Any | None:
    """Dynamo's record of the code objects it has compiled since its last reset
    (weak references in ``seen``; ``None``: this torch keeps none)."""
    try:
        from torch._dynamo.convert_frame import input_codes
    except ImportError:
        return None
    return input_codes if hasattr(input_codes, "seen") else None
