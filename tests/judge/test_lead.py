"""Real overflows keep their warning: each fault case below is trained until its loss is
non-finite, watched at defaults (the demo's drill at its own settings), and its first
warning (the forecast, or max |x| past 256 in fp16) comes at least 10 steps before the
first non-finite loss.

The healthy side of the same rule (a healthy zoo stays quiet) is
``tests/judge/test_zoo.py``.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable

import pytest
import torch
from rich.console import Console
from torch import nn

import normwatch
from normwatch.demos.demo import run_demo
from normwatch.demos.toymodel import NaiveRMSNorm, TinyLM, lm_loss, synthetic_batch
from normwatch.records import Alarm
from tests.conftest import tiny_hf

LEAD = 10
Case = tuple[nn.Module, Callable[[], object], Callable[[], torch.Tensor]]
"""A fault case: the model, what grows before each step, the step's loss."""


def until_nan(model: nn.Module, grow: Callable[[], object], loss_of: Callable[[], torch.Tensor],
              steps: int = 400) -> tuple[int | None, list[Alarm]]:
    """Train (AdamW, defaults of the watch) until the loss is non-finite; ``grow`` runs
    before each step (the fault). The first non-finite step and the alarms."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    with normwatch.watch(model, optimizer, report_dir=None, report_console=False) as w:
        for step in range(1, steps + 1):
            with torch.no_grad():
                grow()
            loss = loss_of()
            loss.float().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            w.step(loss)
            if not math.isfinite(float(loss.detach())):
                return step, list(w.alarms)
    return None, list(w.alarms)


def t5_residual() -> Case:
    """A T5 in pure fp16 whose embeddings (its residual stream) grow 7 %/step; T5's norms
    reduce in fp32, so the stream itself overflows (attention, then the residual)."""
    model = tiny_hf("t5").half()
    model.config.decoder_start_token_id = 0
    ids = torch.randint(1, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    return (model, lambda: model.shared.weight.mul_(1.07),
            lambda: model(input_ids=ids, labels=ids).loss)


def gpt_residual() -> Case:
    """A pre-norm GPT (torch's RMSNorm, fp32 reductions) in fp16, its residual stream
    growing 7 %/step."""
    model = TinyLM(norm="rmsnorm").half()
    tokens = synthetic_batch(torch.Generator().manual_seed(0))
    return (model, lambda: model.residual_scale.mul_(1.07),
            lambda: lm_loss(model(tokens), tokens))


class HandWrittenRMSNorm(NaiveRMSNorm):
    """Llama's RMSNorm written the way many codebases do: ``x.pow(2)`` in the input dtype."""


def llama_hand_written_norm() -> Case:
    """A Llama in pure fp16 whose norms are hand-written and square in fp16, its embeddings
    growing 7 %/step."""
    model = tiny_hf("llama")
    for name, module in list(model.named_modules()):
        if type(module).__name__ == "LlamaRMSNorm":
            parent, _, child = name.rpartition(".")
            norm = HandWrittenRMSNorm(module.weight.shape[0], eps=module.variance_epsilon)
            setattr(model.get_submodule(parent) if parent else model, child, norm)
    embed = model.get_input_embeddings()
    weight = embed.weight
    nn.init.normal_(weight, std=1.0)  # (at 0.02, rsqrt's fp16 backward overflows)
    model.half()
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    return (model, lambda: weight.mul_(1.07),
            lambda: model(input_ids=ids, labels=ids).loss)


def first_warning(alarms: list[Alarm]) -> Alarm:
    loud = [a for a in alarms if a.severity in ("warning", "critical")]
    assert loud, "no warning before the NaN"
    return loud[0]


@pytest.mark.parametrize("case", [t5_residual, gpt_residual, llama_hand_written_norm])
def test_a_growing_fp16_residual_is_forecast_at_least_10_steps_before_the_nan(
        case: Callable[[], Case],
        ) -> None:
    nan_step, alarms = until_nan(*case())
    assert nan_step is not None, "the fault never produced a non-finite loss"
    first = first_warning(alarms)
    assert first.kind in ("fp16_headroom", "fp16_overflow")
    assert nan_step - first.step >= LEAD, (first.step, nan_step)


def test_the_demos_fp16_drill_is_forecast_at_least_10_steps_before_the_nan() -> None:
    result = run_demo("fp16-overflow", console=Console(file=io.StringIO(), width=200),
                      live=False, report_dir=None)
    assert result.nan_step is not None
    first = first_warning(result.alarms)
    assert first.kind == "fp16_headroom"
    assert result.nan_step - first.step >= LEAD, (first.step, result.nan_step)
