"""The demo's failure drills: how each builds its model and what it does before a step.

No torch at import (the command line lists the drills without loading it): the drills
import it when they run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from normwatch.demos.toymodel import TinyLM


@dataclass(frozen=True)
class Fault:
    """A failure drill: how to build the model, and what happens before each step."""

    name: str
    summary: str
    norm: str = "rmsnorm"
    dtype: str = "float32"
    """The model's dtype (a ``torch`` attribute name)."""
    eps: float = 1e-6
    padding: bool = False
    lr: float = 0.05
    before_step: Callable[[TinyLM, int], None] = field(default=lambda model, step: None)
    prepare: Callable[[TinyLM], None] = field(default=lambda model: None)
    batch: Callable[[torch.Tensor, int], torch.Tensor] = field(default=lambda tokens, step: tokens)
    lr_factor: Callable[[int], float] = field(default=lambda step: 1.0)
    """The learning rate of a step, as a factor of ``lr`` (a schedule)."""


def _grow_residual(model: TinyLM, step: int) -> None:
    model.residual_scale.mul_(1.07)  # the residual stream drifts up 7 %/step


def _break_mlp(model: TinyLM, step: int) -> None:
    model.blocks[1].mlp.fault = step >= 30


def _fp32_norm_weights(model: TinyLM) -> None:
    model.norm.float()  # a norm left in fp32 inside a bf16 model


def _corrupt_batch(tokens: torch.Tensor, step: int) -> torch.Tensor:
    import torch

    if step != 80:
        return tokens
    gen = torch.Generator().manual_seed(step)
    return torch.randint(1, 64, tokens.shape, generator=gen)  # a shuffled, meaningless batch


def _lr_spike(step: int) -> float:
    return 100.0 if step == 80 else 1.0  # a schedule bug: one step at 100x


def _common_mode(model: TinyLM) -> None:
    import torch

    with torch.no_grad():
        model.embed.weight.add_(30.0)  # every token rides on a large shared offset


FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("fp16-overflow", "fp16 model, hand-written RMSNorm reducing in fp16, residual stream "
          "growing 7 %/step", norm="naive_rmsnorm", dtype="float16",
          before_step=_grow_residual),
    Fault("eps-zero", "LayerNorm with eps = 0 fed all-zero padding tokens", norm="layernorm",
          eps=0.0, padding=True),
    Fault("nan-mlp", "a NaN born inside block 1's MLP at step 30", before_step=_break_mlp),
    Fault("wrong-dim", "an RMSNorm that reduces over the batch instead of the features",
          norm="batchdim_rmsnorm"),
    Fault("dtype-mismatch", "bf16 model whose final norm kept fp32 weights",
          dtype="bfloat16", prepare=_fp32_norm_weights),
    Fault("common-mode", "RMSNorm inputs dominated by a shared offset", prepare=_common_mode),
    Fault("bad-batch", "a corrupted data batch (random tokens) at step 80", batch=_corrupt_batch),
    Fault("lr-spike", "the learning rate at 100x for the one step 80", lr_factor=_lr_spike),
    Fault("none", "a healthy fp16 run with torch's RMSNorm", dtype="float16"),
)}
DEFAULT_FAULT = "fp16-overflow"
