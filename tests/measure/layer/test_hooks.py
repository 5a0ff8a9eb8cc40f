"""The forward hook: what counts as a call, failures, odd inputs, dtypes, removal
(activation checkpointing, eager and compiled: tests/measure/layer/test_compile.py)."""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import normwatch
from normwatch.catalog import COLUMNS
from normwatch.demos.toymodel import TinyLM, synthetic_batch
from normwatch.measure.backends import choose
from normwatch.measure.backends.native import lane as fastlane
from normwatch.measure.backends.native.backend import NativeBackend
from normwatch.measure.backends.triton_kernel import usable as triton_usable
from normwatch.measure.layer.hooks import LayerHook
from normwatch.measure.layer.recorder import Recorder, Runtime
from normwatch.measure.model.discovery import describe
from normwatch.measure.state.accumulator import Accumulator
from tests.test_watch import train

BACKENDS = partial(choose, kernel="auto")
"""Each device's backend, as a watch at defaults chooses."""


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


def test_a_no_grad_training_forward_leaves_no_recompute_to_the_next_step() -> None:
    """A training-mode forward without grad (a no-grad pass that left the model in train
    mode) waits for a reentrant checkpoint's recompute in its step only: the next step's
    checkpoint, recomputed by two backward passes, counts once."""
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    w = normwatch.watch(model, report_dir=None)
    x = torch.randn(3, 8, requires_grad=True)
    for _ in range(2):  # (the second: its step begins with the tiers as they were)
        with torch.no_grad():
            model(x)
        w.step()
    loss = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=True).sum()
    loss.backward(retain_graph=True)
    loss.backward()  # recomputed again: not a call of this step's forward
    w.step()
    stats = w.flush().layers["1"]
    assert (stats.calls, stats.tokens) == (1, 3)
    w.close()


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
    real = NativeBackend.call_rows  # (the backend of CPU tensors: what reads the call)

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        if broken.calls == 0:  # type: ignore[attr-defined]
            broken.calls += 1  # type: ignore[attr-defined]
            raise RuntimeError("kernel exploded")
        return real(*args, **kwargs)

    broken.calls = 0  # type: ignore[attr-defined]
    monkeypatch.setattr(NativeBackend, "call_rows", broken)
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
    rt = Runtime(Accumulator(1, BACKENDS))
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
    rt = Runtime(Accumulator(1, BACKENDS), paused=True)
    hook = LayerHook(layer, norm, 0, rt)
    norm(torch.randn(3, 4, requires_grad=True))
    assert hook.counts.calls == 0


class GatedRMSNorm(nn.Module):
    """An RMS norm that may take a gate (a second tensor: such a call is not the one an
    output check reads)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return y if gate is None else y * torch.sigmoid(gate)


class _Lanes(nn.Module):
    """A layer norm, an RMS norm called twice, a gated norm whose first call has a gate,
    and norms inside activation checkpoints (reentrant: recomputed and counted inside
    backward; not: recomputed, not counted): calls the sentinel's lane takes and calls
    it leaves to the general path."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(48)
        self.rms = nn.RMSNorm(48, eps=1e-6)
        self.gated = GatedRMSNorm(48)
        self.lin = nn.Linear(48, 48)
        self.inner = nn.Sequential(nn.Linear(48, 48), nn.RMSNorm(48))
        self.last = nn.Sequential(nn.Linear(48, 48), nn.LayerNorm(48))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.rms(self.lin(self.ln(x)))
        h = self.rms(h + x)
        h = self.gated(h, gate=x) + self.gated(h)
        h = torch.utils.checkpoint.checkpoint(self.inner, h, use_reentrant=True)
        return torch.utils.checkpoint.checkpoint(self.last, h, use_reentrant=False)


FLUSHED = (5, 8, 15)
"""Steps the lane's loop flushes after: its second interval (6-8) has sentinel steps only
(``stats_every=4``), run under autocast, and no output check (``output_check_every=2``:
its first calls are the lane's)."""


def _lane_run(monkeypatch: pytest.MonkeyPatch, cpp: bool = False, kernel: str = "auto"
              ) -> tuple[list[object], tuple[int, int, int]]:
    """Each interval's raw rows, host counts and snapshot of one loop (token counts that
    change from step to step, eval and no-grad forwards between steps, two backward
    passes in one step, a NaN in one step, autocast over one interval and from a full-tier
    step inside another), and how many calls the Python recorder recorded: of each tier
    past each layer's interval's first, and first calls (``cpp``: the C++ lane takes what
    it covers first; ``kernel``: the watch's)."""
    taken = [0, 0, 0]  # sentinel-tier calls, full-tier calls, the intervals' first
    real = Recorder.record
    state = fastlane.state
    monkeypatch.setattr(fastlane, "state", lambda *a: state(*a) if cpp else None)

    def taking(self: Recorder, *args: object) -> None:
        taken[2 if not self.counts.calls else self.rt.full_stats] += 1
        real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Recorder, "record", taking)
    torch.manual_seed(0)
    model = _Lanes()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = normwatch.watch(model, opt, stats_every=4, flush_every=100, output_check_every=2,
                        report_dir=None, kernel=kernel)
    assert len(w._measure._hooks) == 5
    gen = torch.Generator().manual_seed(1)
    out: list[object] = []
    for step in range(1, 16):
        x = torch.randn(3, 5 + step % 3, 48, generator=gen, requires_grad=True)
        if step == 12:
            x.data[1, 2, 5] = float("nan")
        with warnings.catch_warnings(), torch.autocast("cpu", torch.bfloat16,
                                                       enabled=6 <= step <= 8 or step >= 13):
            warnings.simplefilter("ignore")
            loss = model(x).float().square().mean()
            loss.backward(retain_graph=step == 3)
            if step == 3:  # the reentrant checkpoint recomputed again: not counted again
                loss.backward()
            opt.step()
            opt.zero_grad()
            model.eval()
            model(x)
            model.train()
            with torch.no_grad():
                model(x)
        w.step()
        if step in FLUSHED:
            counts = [repr(h.counts) for h in w._measure._hooks]
            out += [w._measure.read()[0], counts, w.flush()]
    w.close()
    monkeypatch.undo()
    return out, (taken[0], taken[1], taken[2])


def _same(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)


@pytest.mark.parametrize("kernel", ["auto", pytest.param("triton", marks=pytest.mark.skipif(
    not triton_usable(), reason="Triton cannot run here"))])
def test_the_lane_measures_as_the_general_path(monkeypatch: pytest.MonkeyPatch,
                                               kernel: str) -> None:
    """The common CPU training call, of either tier (the full tier's gradients hooked and
    dtypes noted there), is recorded by the C++ lane with no Python frame; every column
    of every layer (the gradients' included), its host counts and the snapshot, interval
    by interval, are what the recorder alone gives: each interval's first call (its
    dtypes noted: autocast in an interval of sentinel steps), the output check (a gated
    call first), eval and no-grad calls, the reentrant checkpoint's recompute inside
    backward and a NaN all left as they were. The lane takes calls of both tiers and
    intervals' first calls from the recorder. So does the launch lane of the Triton
    backend (CUDA's; here in Triton's interpreter), whose full tier's gradients Python
    hooks."""
    if fastlane.module() is None:
        pytest.skip("no C++ lane here")
    general, recorded = _lane_run(monkeypatch, kernel=kernel)
    assert recorded[0] > 20 and recorded[1] > 5 and recorded[2] > 2
    cpp, left = _lane_run(monkeypatch, cpp=True, kernel=kernel)
    taken = [a - b for a, b in zip(recorded, left, strict=True)]
    assert taken[0] > 20 and taken[1] > 5 and taken[2] > 2, (recorded, left)
    _same_intervals(cpp, general)


def _same_intervals(lane: list[object], general: list[object]) -> None:
    """Two :func:`_lane_run` runs' intervals alike (raw columns, host counts, snapshots)."""
    assert len(lane) == len(general) == 3 * len(FLUSHED)
    for got, want in zip(lane, general, strict=True):
        if not isinstance(got, list) or not isinstance(got[0], dict):
            assert repr(got) == repr(want)  # host counts; the interval as reported
            continue
        for row, expected in zip(got, want, strict=True):  # type: ignore[call-overload]
            assert row.keys() == expected.keys()
            bad = [k for k in row if not _same(row[k], expected[k])]
            assert not bad, [(k, row[k], expected[k]) for k in bad]
    assert any(row["nonfinite"] > 0 for row in lane[-3])  # type: ignore[attr-defined]
    assert "bfloat16" in repr(lane[4]) and "bfloat16" not in repr(lane[1])
    assert "bfloat16" in repr(lane[7])  # from step 13 on, a full-tier step in the interval
