"""Find the normalization layers of a model.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    >>> [(n.name, n.kind, n.eps) for n in find_norm_layers(model)]
    [('1', 'layernorm', 1e-05)]

Recognised, in this order: classes registered with :func:`register_norm`; torch's
LayerNorm, RMSNorm, GroupNorm, BatchNorm and InstanceNorm families; any other module
whose class name contains ``Norm`` (Hugging Face's ``LlamaRMSNorm``, ``T5LayerNorm``,
``CohereLayerNorm``, ``MambaRMSNormGated``, ...) and that has a ``weight`` and an
``eps``-like attribute. Such a module's kind and token are decided by its behaviour
(:func:`behaviour`: its output on a crafted input against the LayerNorm and RMSNorm
formulas), its name only where it cannot be run. A matched norm's children are not
searched.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from normwatch.errors import ConfigError
from normwatch.measure.model.isolation import hookless_copy, isolated
from normwatch.measure.model.reference import (
    carried_eps,
    flattens_heads,
    layer_norm,
    per_head_norms,
    rms_norm,
)
from normwatch.records import KINDS, Kind, NormLayer, WeightForm

EPS_ATTRS = ("eps", "variance_epsilon", "epsilon", "variance_eps")
# Wrapper modules that add a path component without meaning.
_WRAPPERS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_forward_module")
# Hugging Face RMSNorms that scale by (1 + w); their weight is initialised at 0.
_ONE_PLUS_W = re.compile(r"^(Gemma\d*n?|PaliGemma|RecurrentGemma|T5Gemma|Qwen3Next)\w*RMSNorm$")


@dataclass(frozen=True)
class _Registration:
    kind: Kind
    eps_attr: str | None
    weight_form: WeightForm


_REGISTRY: dict[type[nn.Module], _Registration] = {}


def register_norm(
    cls: type[nn.Module],
    *,
    kind: Kind,
    eps_attr: str | None = "eps",
    weight_form: WeightForm = "w",
) -> None:
    """Declare a custom norm class, overriding the built-in recognition.

        >>> class MyNorm(torch.nn.Module): ...
        >>> register_norm(MyNorm, kind="rmsnorm", eps_attr="epsilon")
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ConfigError(f"'cls' must be a torch.nn.Module subclass: got {cls!r}")
    if kind not in KINDS:
        raise ConfigError(f"'kind' must be one of {', '.join(map(repr, KINDS))}: got {kind!r}")
    if eps_attr is not None and not isinstance(eps_attr, str):
        raise ConfigError(f"'eps_attr' must be a str or None: got {eps_attr!r}")
    if weight_form not in ("w", "1+w"):
        raise ConfigError(f"'weight_form' must be 'w' or '1+w': got {weight_form!r}")
    _REGISTRY[cls] = _Registration(kind, eps_attr, weight_form)


def unregister_norm(cls: type[nn.Module]) -> None:
    """Forget a registration made with :func:`register_norm` (no-op if absent)."""
    _REGISTRY.pop(cls, None)


def clean_name(qualified: str) -> str:
    """Strip wrapper components (DDP's leading ``module.``, ``_orig_mod.``, FSDP's, ...)."""
    parts = qualified.split(".") if qualified else []
    while parts and parts[0] == "module":
        parts.pop(0)
    return ".".join(p for p in parts if p not in _WRAPPERS)


def describe(module: nn.Module, name: str = "") -> NormLayer | None:
    """Return the :class:`NormLayer` for ``module`` if it is a norm, else ``None``."""
    cls_name = type(module).__name__
    for klass in type(module).__mro__:
        reg = _REGISTRY.get(klass)
        if reg is not None:
            eps = _eps(module, (reg.eps_attr,) if reg.eps_attr else ())
            shape = _weight_shape(module) if reg.kind in ("layernorm", "rmsnorm") else None
            groups = getattr(module, "num_groups", None) if reg.kind == "groupnorm" else None
            return NormLayer(name, reg.kind, eps, shape, reg.weight_form, cls_name, groups)
    # torch's own classes (not subclasses with their own forward): one op each
    builtin = type(module).__module__.startswith("torch.nn.")
    if isinstance(module, _TORCH_NORMS) and not _torch_forward(module):
        # a subclass of torch's norm computing its own way (Nemotron's 1 + w)
        found = _per_head(module, name) or _duck_typed(module, name)
        if found is not None:
            return found
    if isinstance(module, nn.LayerNorm | nn.RMSNorm):
        eps = module.eps if module.eps is not None else _default_rms_eps()
        return NormLayer(name, _builtin_kind(module), float(eps),
                         tuple(module.normalized_shape), "w", cls_name, builtin=builtin)
    if isinstance(module, nn.GroupNorm):
        return NormLayer(name, "groupnorm", float(module.eps), (module.num_channels,), "w",
                         cls_name, module.num_groups, builtin)
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        return NormLayer(name, "instancenorm", float(module.eps), (module.num_features,), "w",
                         cls_name, builtin=builtin)
    if isinstance(module, nn.modules.batchnorm._NormBase):
        return NormLayer(name, "batchnorm", float(module.eps), (module.num_features,), "w",
                         cls_name, builtin=builtin)
    return _per_head(module, name) or _duck_typed(module, name)


_TORCH_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm,
                nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm)


def _torch_forward(module: nn.Module) -> bool:
    """Whether ``module`` runs one of torch's own norm forwards (else a subclass's)."""
    forward = type(module).forward
    return any(forward is c.forward for c in _TORCH_NORMS)


def find_norm_layers(
    model: nn.Module,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
) -> list[NormLayer]:
    """List the norm layers of ``model`` in registration order (see module docstring).

    ``include``/``exclude`` are glob patterns (``fnmatch``) on the cleaned layer name.
    """
    return [layer for layer, _ in iter_norm_modules(model, include, exclude)]


def iter_norm_modules(
    model: nn.Module,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
) -> Iterator[tuple[NormLayer, nn.Module]]:
    """Yield ``(NormLayer, module)`` pairs; a module reachable twice is yielded once."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"'model' must be a torch.nn.Module: got {type(model).__name__}")
    seen: set[int] = set()

    def walk(module: nn.Module, prefix: str) -> Iterator[tuple[NormLayer, nn.Module]]:
        if id(module) in seen:
            return
        seen.add(id(module))
        layer = describe(module, clean_name(prefix))
        if layer is not None:
            if _selected(layer.name, include, exclude):
                yield layer, module
            return
        for child_name, child in module.named_children():
            yield from walk(child, f"{prefix}.{child_name}" if prefix else child_name)

    yield from walk(model, "")


def _selected(name: str, include: Sequence[str], exclude: Sequence[str]) -> bool:
    if include and not any(fnmatch.fnmatchcase(name, p) for p in include):
        return False
    return not any(fnmatch.fnmatchcase(name, p) for p in exclude)


def _builtin_kind(module: nn.Module) -> Kind:
    return "rmsnorm" if isinstance(module, nn.RMSNorm) else "layernorm"


def _default_rms_eps() -> float:
    return float(torch.finfo(torch.float32).eps)  # what nn.RMSNorm uses for eps=None


def _eps(module: nn.Module, attrs: Sequence[str]) -> float:
    for attr in attrs:
        value = getattr(module, attr, None)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return math.nan


def _heads(module: nn.Module) -> tuple[int, int] | None:
    """``(num_heads, head_dim)`` of a norm that takes its input split into heads (xLSTM's
    ``xLSTMMultiHeadLayerNorm``: a flat weight over all heads), else ``None``."""
    heads, width = getattr(module, "num_heads", None), getattr(module, "head_dim", None)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 1
               for v in (heads, width)):
        return None
    shape = _weight_shape(module)
    if shape is not None and math.prod(shape) != heads * width:  # type: ignore[operator]
        return None
    return heads, width  # type: ignore[return-value]


def _weight_shape(module: nn.Module) -> tuple[int, ...] | None:
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor):
        return tuple(weight.shape)
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, int):
        return (shape,)
    if isinstance(shape, tuple | list):
        return tuple(int(s) for s in shape)
    return None


def _per_head(module: nn.Module, name: str) -> NormLayer | None:
    """A per-head wrapper as one layer of its heads' kind, one token per head and row."""
    norms = per_head_norms(module)
    if norms is None:
        return None
    heads = [describe(n) for n in norms]
    first = heads[0]
    if first is None or first.kind not in ("layernorm", "rmsnorm") or any(
            h is None or (h.kind, h.eps, h.normalized_shape) !=
            (first.kind, first.eps, first.normalized_shape) for h in heads):
        return None
    return NormLayer(name, first.kind, first.eps, first.normalized_shape, first.weight_form,
                     type(module).__name__)


def _duck_typed(module: nn.Module, name: str) -> NormLayer | None:
    cls_name = type(module).__name__
    lowered = cls_name.lower()
    if "norm" not in lowered:
        return None
    eps = _eps(module, EPS_ATTRS)
    has_weight = isinstance(getattr(module, "weight", None), torch.Tensor)
    if math.isnan(eps):  # eps hard-coded in forward (OLMo): only if it behaves like a norm
        seen = behaviour(module, 0.0)
        if seen is None:
            return None
        measured = measured_eps(module, seen[1] or (_heads(module) or _weight_shape(module)
                                                   or _FREE_DIMS)[-1:])
        return NormLayer(name, seen[0], measured, seen[1], seen[2], cls_name,
                         eps_measured=not math.isnan(measured))
    has_bias = getattr(module, "bias", None) is not None
    # T5-style "LayerNorm"s (T5, MT5, LongT5, Pix2Struct, ...) are RMSNorms: no bias and
    # Llama's `variance_epsilon` spelling.
    t5_style = not has_bias and hasattr(module, "variance_epsilon")
    kind: Kind
    if "group" in lowered:
        kind = "groupnorm"
    elif "rms" in lowered or t5_style:
        kind = "rmsnorm"
    elif "layer" in lowered or has_bias:
        kind = "layernorm"
    else:
        kind = "rmsnorm"
    form: WeightForm = "1+w" if _ONE_PLUS_W.match(cls_name) else "w"
    groups = getattr(module, "num_groups", None) if kind == "groupnorm" else None
    shape = _weight_shape(module)
    if kind == "groupnorm" and shape is not None:
        shape = shape[:1]
    if kind in ("layernorm", "rmsnorm"):
        seen = behaviour(module, eps)
        if seen is not None:
            kind, shape, form = seen
        elif not has_weight or not lowered.endswith("norm"):
            return None  # "Norm" in the name, but it does not behave like one
    elif not has_weight:
        return None
    return NormLayer(name, kind, eps, shape, form, cls_name, groups)


_FREE_DIMS = (4, 16)
"""The token layout tried on a norm with no weight and no normalized_shape."""


def behaviour(module: nn.Module, eps: float
              ) -> tuple[Kind, tuple[int, ...] | None, WeightForm] | None:
    """What a layer/RMS-like norm computes: run a copy on a crafted input (a common mode,
    a different scale per element) and compare its output with LayerNorm and RMSNorm over
    each candidate token (the weight's trailing dims, or a ``group_size`` chunk), scaled by
    ``w`` or ``1 + w``; a norm that requires a gate gets one wide open, and matches up
    to a constant scale. Returns the kind, the token shape (``None``: the input's last dim)
    and the weight form; ``None`` when it cannot be run or matches nothing."""
    weight = getattr(module, "weight", None)
    weight = weight if isinstance(weight, torch.Tensor) else None
    if (weight is not None and (weight.is_meta or weight.dim() == 0)) or \
            hasattr(module, "running_mean"):
        return None
    heads = _heads(module)
    dims = heads or _weight_shape(module)
    free = not dims
    dims = dims or _FREE_DIMS
    if math.prod(dims) > 1 << 16:
        return None
    tokens = [dims[len(dims) - j :] for j in range(1, len(dims) + 1)]
    group = getattr(module, "group_size", None)
    if isinstance(group, int) and 0 < group < dims[-1] and dims[-1] % group == 0:
        tokens.append((group,))
    dtype = weight.dtype if weight is not None else torch.float32
    device = weight.device if weight is not None else torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    lead = (3, 2) if heads else (3,)  # a split-heads input is (batch, seq, heads, width)
    x = torch.randn((*lead, *dims), generator=g, dtype=torch.float64)
    x = x * torch.linspace(0.5, 2.0, math.prod(dims), dtype=torch.float64).reshape(dims) + 1.5
    y = _run(module, x.to(device, dtype))
    gated = y is None  # a required second input: a gate, run wide open
    if gated:
        y = _run(module, x.to(device, dtype), torch.full(x.shape, 20.0, dtype=dtype,
                                                       device=device))
    y = y[0] if isinstance(y, tuple | list) and y else y
    if isinstance(y, torch.Tensor) and flattens_heads(x.shape, y.shape):
        y = y.reshape(x.shape)  # (.., heads, head_dim) in, (.., heads * head_dim) out
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    # the formula matches to the precision the output carries (an fp32 norm whose
    # output is rounded through bf16 is still that norm)
    carried = float(carried_eps(y.detach()))
    x, y = x.to(dtype).double(), y.detach().double().cpu()  # what the module saw
    w = weight.detach().double().cpu().reshape(dims) if weight is not None else torch.ones(())
    bias = getattr(module, "bias", None)
    b = bias.detach().double().cpu().reshape(dims) if isinstance(bias, torch.Tensor) \
        else torch.zeros(())
    forms: tuple[WeightForm, ...] = ("w", "1+w") if weight is not None else ("w",)
    best: tuple[float, Kind, tuple[int, ...], WeightForm] | None = None
    for kind in ("layernorm", "rmsnorm"):
        for token in tokens:
            formula = layer_norm if kind == "layernorm" else rms_norm
            unit = formula(x.reshape(-1, math.prod(token)), eps).double().reshape(x.shape)
            for form in forms:
                ref = unit * (w + 1.0 if form == "1+w" else w) + b
                if gated:  # silu(20) = 20, sigmoid(20) = 1: the formula up to a scale
                    ref = ref * float((y * ref).sum() / ref.pow(2).sum().clamp_min(1e-30))
                err = float(torch.linalg.vector_norm(y - ref) / torch.linalg.vector_norm(ref))
                if best is None or err < best[0]:
                    best = (err, kind, token, form)
    tol = max(1e-3 if dtype in (torch.float32, torch.float64) else 5e-2, 4 * carried)
    if best is None or not best[0] < tol:
        return None
    shape = None if free and best[2] == dims[-1:] else best[2]
    return best[1], shape, best[3]


SMALL_SCALE = 0.01
"""The element size of :func:`measured_eps`'s small token (mean square 1e-4, where an eps
of 1e-8..1e-2 moves the output measurably)."""


def measured_eps(module: nn.Module, token: tuple[int, ...]) -> float:
    """The eps a layer/RMS norm applies, from its output (NaN when it cannot be told).

    Tokens of ±a (mean 0, so mean square = variance = c·a²) are normalised to
    ``w · a/√(c·a² + ε)``; the output for ``+x`` minus that for ``-x`` removes any bias,
    and its ratio at ``a = 0.01`` and ``a = 1`` removes the weight, leaving
    ``r = a·√(c + ε)/√(c·a² + ε)``, so ``ε = c·a²(1 − r²)/(r² − a²)``. Run in float64
    on an isolated, hookless copy."""
    weight = getattr(module, "weight", None)
    device = weight.device if isinstance(weight, torch.Tensor) else torch.device("cpu")
    n = math.prod(token)
    if n < 2 or n > 1 << 16 or device.type == "meta":
        return math.nan
    signs = torch.ones(n, dtype=torch.float64)
    signs[1::2] = -1.0
    if n % 2:
        signs[-1] = 0.0  # an odd width: the mean stays 0
    c = float(signs.square().mean())
    x = signs.reshape(1, *token)
    try:
        with isolated(device):
            clone = hookless_copy(module).double()
            diffs = [clone(a * x.to(device)) - clone(-a * x.to(device)) for a in (SMALL_SCALE, 1.0)]
    except Exception:  # needs other inputs: no measurement
        return math.nan
    small, big = (d[0] if isinstance(d, tuple | list) else d for d in diffs)
    if not isinstance(small, torch.Tensor) or small.shape != big.shape:
        return math.nan
    keep = big.abs() > 1e-6
    if not bool(keep.any()):
        return math.nan
    r = float((small[keep] / big[keep]).median())
    a2 = SMALL_SCALE ** 2
    if not a2 < r * r <= 1.0:
        return math.nan
    return max(0.0, c * a2 * (1.0 - r * r) / (r * r - a2))


def _run(module: nn.Module, *inputs: torch.Tensor) -> object | None:
    """A hookless copy of ``module`` on ``inputs``, isolated (no hook runs, no grad, the
    RNG untouched); ``None`` if it raises."""
    try:
        with isolated(inputs[0].device):
            out: object = hookless_copy(module)(*inputs)
            return out
    except Exception:  # needs other inputs, or is not a norm at all
        return None
