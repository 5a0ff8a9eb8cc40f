"""The hot path never synchronises with the host; ``flush()`` is the only copy.

On the CPU there is no sync-debug mode, so the test patches every host-sync entry point
(``.item()``, ``.cpu()``, ``.tolist()``, ``bool()``/``float()``/``int()`` of a tensor,
``nonzero``, boolean masking, ...) to record calls made from normwatch's own code, and
fails if any happens outside ``flush()``. A negative control proves the trap works. On a
GPU, ``torch.cuda.set_sync_debug_mode("error")`` does the same from the driver's side.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import normwatch
import normwatch.measure.layer.hooks
from normwatch.demos.toymodel import TinyLM, lm_loss, synthetic_batch
from normwatch.measure.state.rows import CallRows

PACKAGE = str(Path(normwatch.__file__).parent)
METHODS = ["item", "cpu", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__",
           "nonzero", "masked_select", "__getitem__", "to"]
FUNCTIONS = ["nonzero", "masked_select", "argwhere", "unique"]


class SyncTrap:
    def __init__(self) -> None:
        self.violations: list[str] = []
        self.allowed = False

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_filename
            if not self.allowed and caller.startswith(PACKAGE) and self._syncs(name, args,
                                                                               kwargs):
                self.violations.append(f"{name} from {Path(caller).name}")
            return fn(*args, **kwargs)

        return guarded

    @staticmethod
    def _syncs(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if name == "__getitem__":
            index = args[1] if len(args) > 1 else None
            items = index if isinstance(index, tuple) else (index,)
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)
        if name == "to":
            target = [a for a in args[1:] if isinstance(a, str | torch.device)]
            target += [kwargs["device"]] if "device" in kwargs else []
            return any(torch.device(t).type == "cpu" for t in target) and \
                args[0].device.type != "cpu"
        return True


@contextmanager
def sync_trap(monkeypatch: pytest.MonkeyPatch) -> Iterator[SyncTrap]:
    trap = SyncTrap()
    for name in METHODS:
        monkeypatch.setattr(torch.Tensor, name, trap.wrap(name, getattr(torch.Tensor, name)))
    for name in FUNCTIONS:
        monkeypatch.setattr(torch, name, trap.wrap(name, getattr(torch, name)))
    real_flush = normwatch.Watch._flush  # what flush() and step()'s flushes run

    def flush(self: normwatch.Watch, **kwargs: Any) -> Any:
        trap.allowed = True
        try:
            return real_flush(self, **kwargs)
        finally:
            trap.allowed = False

    monkeypatch.setattr(normwatch.Watch, "_flush", flush)
    yield trap


def run(steps: int, nan_at: int | None = None, fold_in_hook: bool = False,
        guard: str | None = None) -> normwatch.Watch:
    """``guard``: ``"fused"`` (a fused AdamW: the guard needs no read) or ``"host"``."""
    model = TinyLM(dim=32, depth=2)
    w = normwatch.watch(model, flush_every=4, output_check_every=1, guard=guard is not None)
    if fold_in_hook:  # every staged call folds at once: the fold runs outside flush()
        w._measure.accumulator.max_staged_tokens = 1
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=guard == "fused")
    w.watch_optimizer(opt)  # the optimizer step hooks are on the hot path too
    for step in range(1, steps + 1):
        model.blocks[1].mlp.fault = step == nan_at
        tokens = synthetic_batch(gen, batch=4, seq=16)
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        if step != nan_at or guard:  # NaN grads are dropped: keep the model usable
            opt.step()
        opt.zero_grad()
        w.step(loss)
    return w


@pytest.mark.parametrize("fold_in_hook", [False, True])
def test_no_host_sync_between_flushes(monkeypatch: pytest.MonkeyPatch,
                                      fold_in_hook: bool) -> None:
    """Compiled calls run these hooks' code too, from their operators' bodies."""
    with sync_trap(monkeypatch) as trap:
        w = run(steps=12, nan_at=6, fold_in_hook=fold_in_hook)
    assert trap.violations == []
    assert w.flushes == 3
    assert any(a.kind == "nonfinite" for a in w.alarms)  # the NaN path was exercised
    assert w.last_snapshot is not None and [u.step for u in w.last_snapshot.updates] == \
        [9, 10, 11, 12]  # the optimizer steps were measured


def test_the_guard_reads_nothing_on_the_fused_path_and_one_element_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with sync_trap(monkeypatch) as trap:
        w = run(steps=12, nan_at=6, guard="fused")
    assert trap.violations == []
    assert w.guard is not None and [(e.step, e.skipped) for e in w.guard.events] == [(6, True)]
    with sync_trap(monkeypatch) as trap:
        w = run(steps=12, nan_at=6, guard="host")
    assert trap.violations == ["tolist from guard.py"] * 12  # one read of 2 flags a step
    assert w.guard is not None and [(e.step, e.skipped) for e in w.guard.events] == [(6, True)]


def test_the_trap_catches_a_sync_in_the_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    from normwatch.measure.backends.native import backend

    real = backend.NativeBackend.call_rows  # (the backend of CPU tensors: what reads a call)

    def leaky(*args: Any, **kwargs: Any) -> CallRows:
        call = real(*args, **kwargs)
        if float(call.hi[0]) < 0:  # a host sync hidden in the hot path
            pass
        return call

    leaky.__code__ = leaky.__code__.replace(co_filename=backend.__file__)
    monkeypatch.setattr(backend.NativeBackend, "call_rows", leaky)
    with sync_trap(monkeypatch) as trap:
        run(steps=2)
    assert trap.violations and trap.violations[0] == "__float__ from backend.py"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sync_debug_mode() -> None:  # pragma: no cover - runs on GPU machines only
    model = TinyLM(dim=64, depth=2).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = normwatch.watch(model, opt, flush_every=10)
    gen = torch.Generator().manual_seed(0)
    batches = [synthetic_batch(gen).cuda() for _ in range(20)]
    for step, tokens in enumerate(batches, 1):
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = lm_loss(model(tokens), tokens)
            loss.backward()
            opt.step()
            if step % 10:
                w.step(loss)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        opt.zero_grad()
        if not step % 10:
            w.step(loss)
    assert w.flushes == 2
    assert w.last_snapshot is not None and len(w.last_snapshot.updates) == 10
