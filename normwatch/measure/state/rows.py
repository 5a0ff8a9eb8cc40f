"""What one call and one gradient record: per-token rows on the activation's device.

    >>> tokens = token_view(x, "groupnorm", groups=8)   # (tokens, elements)
    >>> call = CallRows(row, key, width, eps, v, n)     # a call's rows, staged until the fold
    >>> grad = GradRows(norms, lo, hi, layer, site, width)

A *token* is one normalized vector: the trailing dims of a layer/RMS norm, one group of a
GroupNorm, one channel of a BatchNorm, one (sample, channel) of an InstanceNorm. A
backend (:mod:`normwatch.measure.backends`) reads a call into a few floats per token
(:class:`CallRows`: each token's max and min of the input and output, then on full-tier
steps its sum, L2 norm and spread) and a gradient into each token's L2 norm and the
gradient's min and max (:class:`GradRows`); the accumulator stages them and folds them
at the end of the step (:mod:`~normwatch.measure.state.fold`,
:mod:`~normwatch.measure.state.grad_fold`). Named tuples: built on the hot path, where a
frozen dataclass costs several times more.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple, cast

import torch

from normwatch.catalog import GRAD_SITES
from normwatch.measure.state.buffers import allocated
from normwatch.records import Kind, NormLayer

_HALF = (torch.float16, torch.bfloat16)


_WIDE = (torch.float32, torch.float64)


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one block of memory in some order of its dims
    (contiguous, channels_last, transposed): then it is read in memory order."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True)
                               if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def plain_samples(samples: Sequence[torch.Tensor]) -> bool:
    """Whether a kernel reads ``samples`` (the update monitor's) as they are: plain strided
    tensors, each blocks ``(blocks, width)`` along a unit last stride or one contiguous
    run."""
    return all(type(s) is torch.Tensor and s.layout == torch.strided
               and (s.stride(1) == 1 if s.dim() == 2 else s.is_contiguous())
               for s in samples)


def summed_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The ``dtype=`` for a norm or sum over a ``dtype`` tensor: fp32 for the half formats
    (their own range overflows), ``None`` (their own) for the rest."""
    return torch.float32 if dtype in _HALF else None


def token_view(x: torch.Tensor, kind: Kind, token_ndim: int = 1, groups: int = 1,
               width: int | None = None) -> torch.Tensor:
    """Reshape ``x`` to ``(tokens, elements)`` for a norm of ``kind``.

    Layer/RMS norms: ``width`` elements per token (consecutive chunks of the trailing
    data: the normalized dims, a head of a per-head norm, a group of a grouped RMSNorm)
    when it divides the input, else the trailing ``token_ndim`` dims. ``groups``: the
    GroupNorm group count.
    """
    if x.dim() == 0:
        return x.reshape(1, 1)
    if kind in ("layernorm", "rmsnorm"):
        if width and x.numel() % width == 0:
            return x.reshape(-1, width)
        nd = max(1, min(token_ndim, x.dim()))
        width = math.prod(x.shape[x.dim() - nd :])
        return x.reshape(-1, max(width, 1))
    if x.dim() == 1:
        return x.reshape(1, -1)
    if kind == "groupnorm":
        return x.reshape(x.shape[0] * groups, -1)
    if kind == "instancenorm":
        return x.reshape(x.shape[0] * x.shape[1], -1) if x.dim() >= 3 else x.reshape(x.shape[0], -1)
    # batchnorm: one token per channel, across the batch and spatial dims
    return x.transpose(0, 1).reshape(x.shape[1], -1)


HI, LO, OUT_HI, OUT_LO = 0, 1, 2, 3
"""The first rows of :attr:`CallRows.v` (of :meth:`CallRows.rows`): each input token's max
and min, then a lined-up output's."""


class Signature(NamedTuple):
    """What the fold's constant vectors depend on for one call (:meth:`CallRows.signature`)."""

    row: int
    n_in: int
    n_out: int
    width: int
    eps: float
    offset: float
    """The call's key relative to the first staged call's."""
    centred: bool
    lined_up: bool


class CallRows(NamedTuple):
    """One norm call, reduced to a few per-token values on its device.

    ``v`` holds them stacked, one allocation per call, ``(k, ...)`` with one element per
    token after the first dim: each token's max and min (``hi``, ``lo``: NaN where the
    token holds a NaN, ±inf where it holds ±inf; max |x| and the non-finite flag in two
    plain reductions; a backend that reads max |x| in one pass gives it for both, NaN
    where the token holds a NaN or an inf); then, for an output whose tokens line up with
    the input's (``lined_up``), the same two of the output; then, full tier, the sum, the
    L2 norm and the *spread* (the L2 norm of the centred token for norms that subtract
    the mean, the L2 norm itself for RMS norms): what eps competes with. Every backend
    writes this one layout.
    """

    row: int
    """The layer's accumulator row."""
    key: float | torch.Tensor
    """The call's position (see :data:`KEY_STRIDE`)."""
    width: int
    eps: float
    v: torch.Tensor
    n: int
    """Input tokens."""
    lined_up: bool = False
    full: bool = False
    """Whether the full statistics were measured (else the sentinel tier)."""
    centred: bool = True
    """The norm subtracts the mean (else an RMS norm)."""
    out: torch.Tensor | None = None
    """``(2, output tokens)``: max and min of each token of an output that does not line
    up with the input (missing: ``None``)."""

    def rows(self) -> torch.Tensor:
        """The input's and (lined up) the output's rows, ``(k, tokens)`` (see ``v``)."""
        return self.v.reshape(self.v.shape[0], -1)

    @property
    def hi(self) -> torch.Tensor:
        return self.rows()[HI]

    @property
    def lo(self) -> torch.Tensor:
        return self.rows()[LO]

    def outs(self) -> torch.Tensor | None:
        """``(2, output tokens)``: each output token's max and min (``None``: no output)."""
        return self.rows()[OUT_HI:OUT_LO + 1] if self.lined_up else self.out

    def signature(self, key0: float | torch.Tensor) -> Signature:
        """What the fold's constant vectors depend on (the same every step for the same
        forward pass): row, token counts, width, eps, the key relative to ``key0``
        (staged calls: float keys), whether the norm centres and whether the output lines
        up."""
        n_out = self.n if self.lined_up else 0 if self.out is None else self.out.shape[1]
        offset = cast(float, self.key - key0)
        return Signature(self.row, self.n, n_out, self.width, self.eps, offset, self.centred,
                         self.lined_up)


def runs(values: Sequence[float], counts: Sequence[int], dtype: torch.dtype,
         device: torch.device) -> torch.Tensor:
    """``values[i]`` repeated ``counts[i]`` times, made on ``device`` by fill kernels (a
    plan's constant vectors: no host-to-device copy)."""
    return torch.cat([torch.full((n,), v, dtype=dtype, device=device)
                      for v, n in zip(values, counts, strict=True)] or
                     [torch.empty(0, dtype=dtype, device=device)])


SITES = tuple(GRAD_SITES)
"""Where a norm's gradients are read (:data:`~normwatch.catalog.GRAD_SITES`)."""
OUT, IN, HIDDEN = (SITES.index(s) for s in ("grad_out", "grad_in", "grad_hidden"))
WEIGHT = len(SITES)
"""The weight gradient's site index in :class:`GradRows` (after :data:`SITES`)."""


class GradRows(NamedTuple):
    """One gradient staged by an eager hook (a named tuple: built on the hot path)."""

    norms: torch.Tensor
    """Each token's L2 norm (one element per token, any shape); the
    weight: its gradient's norm (0-d, or first of the C kernel's three: its norm, min and
    max); :attr:`packed`, one buffer: the C kernel's tokens' norms, then the gradient's
    min and max (:func:`~normwatch.measure.backends.native.readers.grad_rows`), or
    (:attr:`rowwise`) the fused kernel's ``(2, tokens)``: each token's norm, then its max
    |g| (NaN where it holds NaN/inf)."""
    lo: torch.Tensor | None
    """The gradient's min and max (0-d; the weight, or packed: ``None``). The fold reads
    ``max(hi, -lo)`` only: both may hold the max |g|."""
    hi: torch.Tensor | None
    layer: int
    """The layer's accumulator row."""
    site: int
    """Index into :data:`SITES`, or :data:`WEIGHT`."""
    width: int
    """Elements per token."""

    @property
    def packed(self) -> bool:
        """Whether :attr:`norms` holds the gradient's min and max (or max |g|) too."""
        return self.lo is None and self.site != WEIGHT

    @property
    def rowwise(self) -> bool:
        """Whether :attr:`norms` is the fused kernel's ``(2, tokens)`` (see there)."""
        return self.lo is None and self.norms.dim() == 2 and self.site != WEIGHT

    @property
    def tokens(self) -> int:
        if self.rowwise:
            return self.norms.shape[1]
        return self.norms.numel() - 2 if self.packed else self.norms.numel()

    def unpacked(self) -> GradRows:
        """The same gradient with its min and max apart (views; rowwise: its max |g| as
        both, one reduction)."""
        if not self.packed:
            return self
        if self.rowwise:
            peak = self.norms[1].amax()
            return self._replace(norms=self.norms[0], lo=peak, hi=peak)
        flat = self.norms.reshape(-1)
        return self._replace(norms=flat[:-2], lo=flat[-2], hi=flat[-1])


assert (OUT, IN, HIDDEN, WEIGHT) == (0, 1, 2, 3)  # (as lane.cpp's gradient hooks name them)


Lend = Callable[..., torch.Tensor]
"""A lender of float32 buffers of a shape (and a device: default the CPU), held until the
accumulator's next fold (:meth:`~normwatch.measure.state.buffers.RowBuffers.take`)."""


@dataclass(slots=True, eq=False)
class LayerRows:
    """What one layer's rows depend on, for every backend: its accumulator row, kind,
    eps, tokens (``width`` elements each where the last dim holds one, else ``None``;
    ``tokens``: its token view), where buffers are lent (``take``: calls', ``grad_take``:
    gradients'), and each backend's per-layer plans (``plans``, theirs to fill)."""

    row: int
    kind: Kind
    eps: float
    width: int | None
    tokens: Callable[[torch.Tensor], torch.Tensor]
    take: Lend
    grad_take: Lend
    one_plus_w: bool = False
    """The weight enters as ``1 + w`` (Gemma's)."""
    plans: dict[object, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, layer: NormLayer, row: int, take: Lend = allocated,
           grad_take: Lend = allocated) -> LayerRows:
        """The rows of ``layer`` (its accumulator row ``row``; buffers from ``take`` and
        ``grad_take``, or allocated)."""
        eps = 0.0 if math.isnan(layer.eps) else layer.eps
        tokens: Callable[[torch.Tensor], torch.Tensor] = partial(
            token_view, kind=layer.kind, token_ndim=len(layer.normalized_shape or (1,)),
            groups=layer.num_groups or 1, width=layer.token_size)
        if layer.token_size is not None:  # layer/RMS norms: the common case first
            tokens = partial(_chunk_tokens, width=layer.token_size, other=tokens)
        return cls(row, layer.kind, eps, layer.token_size, tokens, take, grad_take,
                   layer.weight_form == "1+w")

    @property
    def centred(self) -> bool:
        """Whether the norm subtracts the mean (the full tier's moments then centre)."""
        return self.kind != "rmsnorm"

    def whole(self, x: torch.Tensor) -> bool:
        """Whether ``x``'s last dim is one token (read as it is: no reshape)."""
        return x.dim() > 0 and x.shape[-1] == self.width

    def token_pair(self, x: torch.Tensor, out: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` as ``(…, elements)`` tokens, and ``out`` in the input's layout (or, for
        an output of another shape, as rows of its last dim), both detached: detached
        tensors record no autograd graph, no ``no_grad()`` context needed."""
        x = x.detach()
        whole = self.whole(x)
        tokens = x if whole else self.tokens(x)
        if out is None:
            return tokens, None
        out = out.detach()
        if out.shape == x.shape:
            return tokens, out if whole else self.tokens(out)
        return tokens, out.reshape(-1, out.shape[-1]) if out.dim() else out.reshape(1, 1)


def _chunk_tokens(x: torch.Tensor, width: int,
                  other: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Tokens of ``width`` elements, straight away when the last dim is one token."""
    return x.reshape(-1, width) if x.dim() and x.shape[-1] == width else other(x)
