"""Is an fp32 output autocast's own rule? Asked of autocast itself, by the op that made it.

    >>> autocast_made("NativeLayerNormBackward0", torch.device("cuda"), torch.float16,
    ...               torch.float16)
    True    # CUDA autocast runs layer_norm in fp32 (on the CPU it does not)

Under autocast an op on the device's fp32 list returns fp32 from low-precision inputs:
that output dtype is by design. A norm whose fp32 output comes from another op (the
``weight * x`` multiply of a hand-written RMSNorm with an fp32 weight) is plain type
promotion in its own code. The op is read from the output's ``grad_fn`` (training calls);
whether autocast lists it is answered by running it once on a tiny input under the same
autocast (cached per op, device, dtypes), not by a hard-coded list that drifts with torch.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F

_OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "NativeLayerNorm": lambda x: F.layer_norm(x, x.shape[-1:]),
    "NativeGroupNorm": lambda x: F.group_norm(x, 2),
    "NativeBatchNorm": lambda x: F.batch_norm(x, None, None, training=True),
    "CudnnBatchNorm": lambda x: F.batch_norm(x, None, None, training=True),
    "MiopenBatchNorm": lambda x: F.batch_norm(x, None, None, training=True),
    "FusedRmsNorm": lambda x: F.rms_norm(x, x.shape[-1:]),
}
"""Backward node names (without the version suffix) → the forward op to ask autocast."""


def output_op(y: torch.Tensor | None) -> str | None:
    """The name of the autograd node that made ``y`` (``None``: no graph recorded)."""
    node = None if y is None else y.grad_fn
    return None if node is None else type(node).__name__


@functools.cache
def autocast_made(op: str, device: torch.device, amp: torch.dtype, dtype: torch.dtype
                  ) -> bool:
    """Whether autocast (``amp`` on ``device``) returns fp32 from the op behind backward
    node ``op`` fed ``dtype`` inputs."""
    probe = _OPS.get(re.sub(r"Backward\d*$", "", op))
    if probe is None:
        return False
    x = torch.linspace(-1.0, 1.0, 16, device=device).reshape(2, 2, 4).to(dtype)
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=amp):
            return probe(x).dtype == torch.float32
    except Exception:  # an op autocast cannot run there: not its rule
        return False
