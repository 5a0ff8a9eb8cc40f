"""What a norm *should* return: the formula of each kind, recomputed in fp32.

    >>> rms_norm(torch.tensor([[1.0, 2.0, 3.0]]), eps=0.0)
    tensor([[0.4629, 0.9258, 1.3887]])

Used by the ``output_mismatch`` check and by the fp16-safety probe. The formulas are
written out here (not borrowed from the layer under test) so that a layer that reduces
over the wrong dimension or misplaces eps disagrees with them; so is how an output is
compared with them (:func:`mismatch`, on the rows :func:`checked_rows` picks) and the
precision it carries (:func:`carried_eps`).
"""

from __future__ import annotations

import math
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


def carried_eps(y: torch.Tensor) -> torch.Tensor:
    """The precision ``y`` carries (0-d float64, on its device): the eps of bf16 if every
    finite value is exact in bf16, else of fp16 if exact there, else of ``y``'s dtype. An
    fp32 output whose last rounding happened in bf16 carries bf16's digits."""
    own = torch.finfo(y.dtype).eps
    if y.dtype == torch.float64:  # not read from the bits: said as it is
        return torch.full((), own, dtype=torch.float64, device=y.device)
    yf = y.float()
    skip = ~torch.isfinite(yf)
    # from the bits, not by a round trip through the narrow dtype (a compiler may drop it)
    bits = yf.view(torch.int32)
    bf16 = (((bits & 0xFFFF) == 0) | skip).all()  # bf16 keeps the top 16 bits
    f16 = ((((bits & 0x1FFF) == 0) & (yf.abs() <= 65504.0)) | skip).all()  # 10-bit mantissa
    carried = torch.where(bf16, 2.0**-7, torch.where(f16, 2.0**-10, own))
    return carried.to(torch.float64)


CHECKED = 16
"""An output check reads ``3 * CHECKED`` rows of a call (:func:`checked_rows`)."""


def checked_rows(hi: torch.Tensor, lo: torch.Tensor, per_row: int) -> torch.Tensor:
    """The rows an output check reads (int64, ``3 * CHECKED``, maybe repeated), from each
    token's max and min (``per_row`` tokens per row): the :data:`CHECKED` tokens reaching
    the largest |x| (where a norm's own arithmetic overflows first), the ones of smallest
    range (where eps matters: a misplaced eps shows there) and ones spread evenly (a wrong
    dimension or dtype shows everywhere). Any token count, no branch on it (compiled
    shapes may be symbolic): short calls pad and repeat."""
    n = hi.shape[0]
    hi, lo = hi.float(), lo.float()
    pad = hi.new_full((CHECKED,), -math.inf)
    big = torch.maximum(hi, -lo).nan_to_num(-1.0, -1.0, -1.0)  # non-finite: last
    narrow = (lo - hi).nan_to_num(-math.inf, -math.inf, -math.inf)
    spread = torch.arange(CHECKED, device=hi.device) * n // CHECKED
    picked = torch.cat([torch.cat([big, pad]).topk(CHECKED).indices,
                        torch.cat([narrow, pad]).topk(CHECKED).indices, spread])
    return picked.clamp_max(n - 1) // per_row


def mismatch(out_tokens: torch.Tensor, ref_tokens: torch.Tensor) -> torch.Tensor:
    """Largest per-token relative L2 error of ``out`` against ``ref``; tokens where either
    is non-finite are skipped (non-finite outputs are counted elsewhere)."""
    y = out_tokens.float()
    ref = ref_tokens.float()
    err = torch.linalg.vector_norm(y - ref, dim=1)
    scale = torch.linalg.vector_norm(ref, dim=1).clamp_min(1e-6 * math.sqrt(ref.shape[1]))
    rel = err / scale
    worst: torch.Tensor = rel.nan_to_num(-math.inf, -math.inf, -math.inf).amax()
    return worst
