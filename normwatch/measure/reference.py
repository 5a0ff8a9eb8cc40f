"""What a norm *should* return: the formula of each kind, recomputed in fp32.

    >>> rms_norm(torch.tensor([[1.0, 2.0, 3.0]]), eps=0.0)
    tensor([[0.4629, 0.9258, 1.3887]])

Used by the ``output_mismatch`` check and by the fp16-safety probe. The formulas are
written out here (not borrowed from the layer under test) so that a layer that reduces
over the wrong dimension or misplaces eps disagrees with them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from normwatch.records import NormLayer


def rms_norm(x: torch.Tensor, eps: float, token_ndim: int = 1) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps)`` over the trailing ``token_ndim`` dims, in fp32."""
    x = x.float()
    dims = tuple(range(-token_ndim, 0))
    return x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)


def layer_norm(x: torch.Tensor, eps: float, token_ndim: int = 1) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the trailing ``token_ndim`` dims, in fp32."""
    x = x.float()
    dims = tuple(range(-token_ndim, 0))
    mean = x.mean(dims, keepdim=True)
    centred = x - mean
    return centred * torch.rsqrt(centred.pow(2).mean(dims, keepdim=True) + eps)


def expected_output(layer: NormLayer, module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The fp32 output ``module`` should give for input ``x``; ``None`` if unknown.

    Unknown means: eps could not be read, or the affine parameters do not fit the
    input (an unusual custom norm), so no honest comparison is possible.
    """
    return expected_from(layer, x, reference_params(layer, module, x), module.training)


REFERENCE_PARAMS = ("weight", "bias", "running_mean", "running_var")
"""What :func:`expected_from` reads of a module, in :func:`reference_params` order."""


def reference_params(layer: NormLayer, module: nn.Module, x: torch.Tensor
                     ) -> tuple[torch.Tensor | None, ...]:
    """The tensors of ``module`` its formula needs (:data:`REFERENCE_PARAMS`), detached
    fp32, the weight as it scales (``1 + w`` forms resolved, per-head norms stacked)."""
    weight, bias = _param(module, "weight"), _param(module, "bias")
    heads = per_head_norms(module)
    if heads is not None:  # head h of x[:, h] scaled by its own norm's parameters
        weight, bias = (_per_head_param(heads, p, x) for p in ("weight", "bias"))
    weight, bias = _fit_heads(weight, x), _fit_heads(bias, x)
    if weight is not None and layer.weight_form == "1+w":
        weight = 1.0 + weight
    return weight, bias, _param(module, "running_mean"), _param(module, "running_var")


def expected_from(layer: NormLayer, x: torch.Tensor, params: tuple[torch.Tensor | None, ...],
                  training: bool) -> torch.Tensor | None:
    """:func:`expected_output` from :func:`reference_params` (pure tensor code)."""
    eps = layer.eps
    if eps != eps:  # NaN: eps attribute not found
        return None
    weight, bias, mean, var = params
    if layer.kind in ("layernorm", "rmsnorm"):
        # tokens: chunks of token_size elements (the normalized dims, a head, a group);
        # the affine parameters cover the input's trailing dims, possibly several tokens
        width = layer.token_size or (x.shape[-1] if x.dim() else 1)
        if x.dim() == 0 or x.numel() % width:
            return None
        formula = rms_norm if layer.kind == "rmsnorm" else layer_norm
        y = formula(x.reshape(-1, width), eps).reshape(x.shape)
        for p in (weight, bias):
            if p is not None and (p.dim() > x.dim() or any(
                    a not in (1, b) for a, b in zip(p.shape, x.shape[x.dim() - p.dim():],
                                                    strict=True))):
                return None
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
        return y
    if x.dim() < 2:
        return None
    channels = x.shape[1]
    for p in (weight, bias):
        if p is not None and tuple(p.shape) != (channels,):
            return None
    xf = x.float()
    if layer.kind == "groupnorm":
        groups = layer.num_groups or 1
        tokens = xf.reshape(x.shape[0], groups, -1)
        y = layer_norm(tokens, eps).reshape(x.shape)
    elif layer.kind == "instancenorm":
        y = layer_norm(xf.reshape(x.shape[0], channels, -1), eps).reshape(x.shape)
    else:
        use_batch = training or mean is None or var is None
        return F.batch_norm(xf, None if use_batch else mean, None if use_batch else var,
                            weight, bias, training=use_batch, eps=eps)
    view = (1, channels) + (1,) * (x.dim() - 2)
    if weight is not None:
        y = y * weight.reshape(view)
    if bias is not None:
        y = y + bias.reshape(view)
    return y


def per_head_norms(module: nn.Module) -> list[nn.Module] | None:
    """The norms of a per-head wrapper (StableLM's ``LayerNormPerHead``: one norm per head
    in a ``ModuleList``, head ``h`` normalizing ``x[:, h]``), else ``None``."""
    if "norm" not in type(module).__name__.lower() or hasattr(module, "weight"):
        return None
    children = list(module.children())
    if len(children) != 1 or not isinstance(children[0], nn.ModuleList) or \
            len(children[0]) < 2:
        return None
    return list(children[0])


def _per_head_param(heads: list[nn.Module], name: str, x: torch.Tensor) -> torch.Tensor | None:
    """The heads' parameters stacked as ``(heads, 1, ..., width)`` against ``x[:, h]``."""
    params = [_param(h, name) for h in heads]
    if any(p is None for p in params) or x.dim() < 3:
        return None
    stacked = torch.stack(params)  # type: ignore[arg-type]
    return stacked.reshape(len(heads), *(1,) * (x.dim() - 3), -1)


def flattens_heads(x: Sequence[int], y: Sequence[int]) -> bool:
    """Whether output shape ``y`` is input shape ``x`` with its last two dims (heads and
    head width) flattened into one (xLSTM's multi-head LayerNorm)."""
    return len(y) >= 1 and len(x) == len(y) + 1 and tuple(x[:-2]) == tuple(y[:-1]) and \
        x[-2] * x[-1] == y[-1]


def _fit_heads(param: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """A flat parameter over all heads of a ``(.., heads, head_dim)`` input, as
    ``(heads, head_dim)``; any other parameter as it is."""
    if param is not None and param.dim() == 1 and x.dim() >= 3 and \
            param.shape[0] != x.shape[-1] and param.shape[0] == x.shape[-2] * x.shape[-1]:
        return param.reshape(x.shape[-2:])
    return param


def _param(module: nn.Module, name: str) -> torch.Tensor | None:
    value = getattr(module, name, None)
    if isinstance(value, torch.Tensor):
        return value.detach().float()
    return None
