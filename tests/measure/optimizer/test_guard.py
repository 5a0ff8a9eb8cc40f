"""guard=True: a step poisoned by one bad batch never reaches the weights — parameters
and optimizer state end bit-equal to a run that never saw that batch; the bound; the
alarms; no host read on the fused path."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import normwatch

BAD = 5
STEPS = 9

Maker = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Maker] = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "sgd-fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(),
                                 nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return MLP().to(dtype)


def batches(dtype: torch.dtype, bad: set[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(1, STEPS + 1):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        if step in bad:
            x[3, 7] = float("nan")  # one bad sample
        out.append((x.to(dtype), y.to(dtype)))
    return out


def train(make: Maker, dtype: torch.dtype, bad: set[int], *, skip_bad: bool = False,
          compiled: bool = False, **watch: object
          ) -> tuple[nn.Module, torch.optim.Optimizer, normwatch.Watch | None]:
    model = mlp(dtype)
    if compiled:
        model.compile(fullgraph=True)
    opt = make(list(model.parameters()))
    w = normwatch.watch(model, opt, report_dir=None, **watch) if watch else None
    for step, (x, y) in enumerate(batches(dtype, bad), start=1):
        if skip_bad and step in bad:
            continue  # the reference: this batch never seen
        loss = (model(x).float() - y.float()).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if w is not None:
            w.step(loss)
    if w is not None:
        w.finish()
    return model, opt, w


def state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state_dict()["state"].values() for v in s.values()
            if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_poisoned_step_leaves_parameters_and_state_as_if_never_taken(
        name: str, dtype: torch.dtype) -> None:
    make = OPTIMIZERS[name]
    if name == "sgd-fused" and dtype == torch.bfloat16:
        pytest.skip("torch's fused SGD on the CPU leaves bf16 momentum buffers that differ "
                    "between two identical unwatched runs: no reference to be equal to")
    ref_model, ref_opt, _ = train(make, dtype, {BAD}, skip_bad=True)
    model, opt, w = train(make, dtype, {BAD}, guard=True, flush_every=3)
    assert w is not None and w.guard is not None
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b)  # bit-equal, finite
    ours, theirs = state_tensors(opt), state_tensors(ref_opt)
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)  # moments, step counts
    [event] = w.guard.events
    assert (event.step, event.skipped) == (BAD, True)
    assert event.reasons == ("a watched norm's input, output or gradient",
                             "the optimizer's gradients")
    [alarm] = [a for a in w.alarms if a.kind == "guard_skipped"]
    assert alarm.severity == "warning" and "skipped 1 optimizer step (step 5)" in alarm.message


def test_on_the_fused_kernels_path_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path (the fused kernel's rows of calls and gradients, the check kernel's
    read of them with the optimizer's gradients; Triton's interpreter without a GPU),
    every step's gradients measured: the same skip, bit-equal, and torch's ops never
    asked."""
    from normwatch.measure.backends import triton_kernel
    from normwatch.measure.optimizer.guard import StepGuard

    if not triton_kernel.usable():
        pytest.skip("Triton cannot run here")

    def by_torch(*args: object) -> None:
        raise AssertionError("the guard read the step by torch's ops")

    monkeypatch.setattr(StepGuard, "_read", by_torch)
    make = OPTIMIZERS["adamw-fused"]
    ref_model, _, _ = train(make, torch.float32, {BAD}, skip_bad=True)
    model, _, w = train(make, torch.float32, {BAD}, guard=True, flush_every=3,
                        kernel="triton", stats_every=1)
    assert w is not None and w.guard is not None
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b)
    [event] = w.guard.events
    assert (event.step, event.skipped) == (BAD, True)
    assert event.reasons[0] == "a watched norm's input, output or gradient"


def test_without_the_guard_the_bad_batch_poisons_the_weights() -> None:
    model, _, w = train(OPTIMIZERS["adamw"], torch.float32, {BAD}, flush_every=3)
    assert w is not None and w.guard is None
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_a_clean_run_is_unchanged_by_the_guard() -> None:
    for name in ("adamw", "adamw-fused"):
        ref, _, _ = train(OPTIMIZERS[name], torch.float32, set())
        model, _, w = train(OPTIMIZERS[name], torch.float32, set(), guard=True)
        assert w is not None and w.guard is not None and w.guard.events == []
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["adamw", "adamw-fused"])
def test_after_max_skips_in_a_row_the_guard_stops_and_raises_a_critical_alarm(
        name: str) -> None:
    model, _, w = train(OPTIMIZERS[name], torch.float32, set(range(3, STEPS + 1)),
                        guard=True, guard_max_skips=3, flush_every=3)
    assert w is not None and w.guard is not None
    assert [(e.step, e.skipped) for e in w.guard.events] == [
        (3, True), (4, True), (5, True), *((s, False) for s in range(6, STEPS + 1))]
    assert not all(torch.isfinite(p).all() for p in model.parameters())  # applied at last
    [exhausted] = [a for a in w.alarms if a.kind == "guard_exhausted"]
    assert exhausted.severity == "critical" and exhausted.step == 6
    assert "skipped 3 poisoned steps in a row and stopped: step 6 was applied" in \
        exhausted.message


def test_closing_the_watch_gives_the_optimizer_its_step_back() -> None:
    model = mlp(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = normwatch.watch(model, opt, guard=True, report_dir=None)
    assert "step" in vars(opt)
    w.close()
    assert "step" not in vars(opt)


def test_one_decision_on_every_rank(tmp_path: Path) -> None:
    """Two gloo ranks, a NaN on rank 1 only: both skip the step, and both end bit-equal
    to a single replica that never saw that batch."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[3]
    subprocess.run([sys.executable, str(root / "tests" / "guard_ranks.py"), str(tmp_path),
                    str(port)], cwd=root, check=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": str(root)})
    ref, _, _ = train(OPTIMIZERS["adamw"], torch.float32, {BAD}, skip_bad=True)
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert saved["skipped"] == [BAD]
        for a, b in zip(saved["params"], ref.parameters(), strict=True):
            assert torch.equal(a, b)


def test_a_compiled_model_is_guarded_without_a_graph_break_or_a_recompile() -> None:
    from torch._dynamo.utils import counters

    torch.compiler.reset()
    ref, _, _ = train(OPTIMIZERS["adamw"], torch.float32, {BAD}, skip_bad=True, compiled=True)
    torch.compiler.reset()
    counters.clear()
    model, _, w = train(OPTIMIZERS["adamw"], torch.float32, {BAD}, compiled=True, guard=True)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1  # the NaN batch recompiles nothing
    assert w is not None and w.guard is not None
    assert [(e.step, e.skipped) for e in w.guard.events] == [(BAD, True)]
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def train_fp16(bad: set[int], *, skip_bad: bool = False, guard: bool = False
               ) -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler,
                          normwatch.Watch | None]:
    model = mlp(torch.float32)
    opt = OPTIMIZERS["adamw"](list(model.parameters()))
    scaler = torch.amp.GradScaler("cpu")
    w = None
    if guard:
        w = normwatch.watch(model, opt, guard=True, report_dir=None, flush_every=3)
        w.watch_scaler(scaler)
    for step, (x, y) in enumerate(batches(torch.float32, bad), start=1):
        if skip_bad and step in bad:
            continue
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = (out.float() - y).square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if w is not None:
            w.step(loss)
    if w is not None:
        w.finish()
    return model, opt, scaler, w


def test_fp16_with_a_grad_scaler_goes_on_as_if_the_bad_batch_was_never_seen() -> None:
    """The scaler skips the NaN step itself; the guard puts its scale and growth tracker
    back (a bad batch is not an fp16 overflow), so everything equals the run without it."""
    ref_model, ref_opt, ref_scaler, _ = train_fp16({BAD}, skip_bad=True)
    model, opt, scaler, w = train_fp16({BAD}, guard=True)
    assert scaler.get_scale() == ref_scaler.get_scale()
    assert torch.equal(scaler._growth_tracker, ref_scaler._growth_tracker)
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(state_tensors(opt), state_tensors(ref_opt), strict=True):
        assert torch.equal(a, b)
    assert w is not None and w.guard is not None
    assert [(e.step, e.skipped) for e in w.guard.events] == [(BAD, True)]
    _, _, plain, _ = train_fp16({BAD})  # unwatched, the scaler lowers its scale
    assert plain.get_scale() == ref_scaler.get_scale() / 2


def test_a_compiled_models_poisoned_gradient_alone_is_caught_in_the_norms() -> None:
    """A finite forward and loss whose backward sends inf into the norms (the sqrt of an
    exact 0): the compiled backward's gradients hold the poison, and the guard names the
    norms' gradients among its reasons."""
    torch.compiler.reset()
    model = mlp(torch.float32)
    model.compile(fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = normwatch.watch(model, opt, report_dir=None, guard=True, stats_every=1)
    assert w.guard is not None
    for step, (x, y) in enumerate(batches(torch.float32, set()), start=1):
        out = model(x)
        loss = (out - y).square().mean()
        if step == BAD:  # forward 0, its gradient inf
            loss = loss + torch.sqrt(out - out.detach()).sum()
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        w.step(loss)
    w.finish()
    [event] = w.guard.events
    assert (event.step, event.skipped) == (BAD, True)
    assert "a watched norm's input, output or gradient" in event.reasons
    assert all(torch.isfinite(p).all() for p in model.parameters())
