"""The forward hook: what counts as a call, failures, odd inputs, dtypes, removal
(activation checkpointing, eager and compiled: tests/measure/test_compile.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import normwatch
from normwatch.catalog import COLUMNS
from normwatch.demos.toymodel import TinyLM, synthetic_batch
from normwatch.measure.accumulator import Accumulator
from normwatch.measure.discovery import describe
from normwatch.measure.hooks import LayerHook, Runtime
from tests.test_watch import train


def test_eval_and_no_grad_forwards_are_not_counted_unless_asked() -> None:
    model = TinyLM(dim=32, depth=1)
    tokens = synthetic_batch(torch.Generator().manual_seed(0), batch=2, seq=8)
    w = normwatch.watch(model)
    model.eval()
    model(tokens)
    model.train()
    with torch.no_grad():
        model(tokens)
    assert w.flush().layers["norm"].calls == 0
    w.close()
    w2 = normwatch.watch(model, count_eval=True)
    model.eval()
    model(tokens)
    assert w2.flush().layers["norm"].calls == 1


def test_module_called_twice_counts_twice() -> None:
    norm = nn.RMSNorm(8)
    lin = nn.Linear(8, 8)
    model = nn.ModuleDict({"norm": norm, "lin": lin})
    w = normwatch.watch(model)
    x = torch.randn(3, 8)
    norm(lin(norm(x))).sum().backward()
    stats = w.flush().layers["norm"]
    assert (stats.calls, stats.tokens) == (2, 6)


def test_hook_failure_disables_that_hook_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    model = TinyLM(dim=32, depth=1)
    w = normwatch.watch(model)
    import normwatch.measure.hooks as hooks

    real = hooks.LayerHook._reduce  # (whichever kernel reads the call)

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        if broken.calls == 0:  # type: ignore[attr-defined]
            broken.calls += 1  # type: ignore[attr-defined]
            raise RuntimeError("kernel exploded")
        return real(*args, **kwargs)

    broken.calls = 0  # type: ignore[attr-defined]
    monkeypatch.setattr(hooks.LayerHook, "_reduce", broken)
    with pytest.warns(RuntimeWarning, match="measuring 'blocks.0.norm1' failed") as record:
        train(model, w, steps=3)
    assert sum("failed" in str(r.message) for r in record) == 1
    assert w.disabled == {"blocks.0.norm1": "RuntimeError: kernel exploded"}
    snap = w.flush()
    assert snap.layers["norm"].calls == 3  # the other layers are still measured
    assert snap.layers["blocks.0.norm1"].calls == 0
    assert model.blocks[0].norm1._forward_hooks == {}


def test_odd_inputs_do_not_crash() -> None:
    class TupleNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))
            self.eps = 1e-5

        def forward(self, x: object, scale: float = 1.0) -> tuple[torch.Tensor, str]:
            if isinstance(x, torch.Tensor):
                return x.float() * self.weight * scale, "extra"
            return torch.zeros(4), "none"

    norm = TupleNorm()
    w = normwatch.watch(norm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        norm(torch.empty(0, 4))                       # empty input
        norm(torch.ones(2, 4, dtype=torch.long))      # integer input
        norm("text")                                  # no tensor at all
        norm(x=torch.randn(3, 4), scale=2.0)          # keyword tensor, tuple output
    messages = [str(c.message) for c in caught]
    assert any("non-floating-point input (torch.int64)" in m for m in messages)
    assert any("no tensor argument" in m for m in messages)
    stats = w.flush().layers[""]
    assert (stats.calls, stats.tokens) == (2, 3)
    assert w.disabled == {}


def test_dtypes_and_autocast_are_recorded_and_remove_is_harmless_twice() -> None:
    norm = nn.RMSNorm(8)
    layer = describe(norm, "norm")
    assert layer is not None
    rt = Runtime(Accumulator(1))
    hook = LayerHook(layer, norm, 0, rt)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        norm(torch.randn(2, 8, requires_grad=True))
    c = hook.counts
    assert (c.input_dtype, c.weight_dtype, c.output_dtype, c.autocast) == (
        "float32", "float32", "float32", "cpu:bfloat16")
    norm(torch.randn(5, 8, dtype=torch.float64, requires_grad=True))
    assert (c.calls, c.tokens, c.input_dtype, c.autocast) == (2, 7, "float64", None)
    assert rt.forward_order == {"norm": 0}
    rows, _ = rt.accumulator.read()
    assert rows[0]["finite_tokens"] == 7 and set(rows[0]) == set(COLUMNS)
    hook.remove()
    hook.remove()
    assert norm._forward_hooks == {}
    norm(torch.randn(1, 8, requires_grad=True))
    assert c.calls == 2


def test_a_paused_runtime_measures_nothing() -> None:
    norm = nn.LayerNorm(4)
    layer = describe(norm, "n")
    assert layer is not None
    rt = Runtime(Accumulator(1), paused=True)
    hook = LayerHook(layer, norm, 0, rt)
    norm(torch.randn(3, 4, requires_grad=True))
    assert hook.counts.calls == 0
