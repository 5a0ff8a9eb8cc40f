"""Was a model compiled before normwatch attached?

``torch.compile`` does not guard on forward hooks (``skip_nnmodule_hook_guards``): code
compiled before :func:`normwatch.watch` keeps running without its hooks, and the watch
would report zeros. :func:`compiled_code` finds such code (cache entries on the forward
of any module class in the model), so the watch can drop it.
"""

from __future__ import annotations

from torch import nn


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
