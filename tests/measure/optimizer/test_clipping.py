"""The loop's clip_grad_norm_ norm, taken by the guard and the update monitor instead of
reading every gradient again; the wrapped function stays exactly torch's."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Iterator

import pytest
import torch

import normwatch
from normwatch.demos.toymodel import TinyLM, lm_loss, synthetic_batch
from normwatch.measure.optimizer import clipping, guard

REAL = getattr(torch.nn.utils.clip_grad_norm_, "__normwatch_real__",
               torch.nn.utils.clip_grad_norm_)


@pytest.fixture(autouse=True)
def unwrapped() -> Iterator[None]:
    """Each test starts with torch's own function and no user of the wrapper (watches
    other tests left open hold it); theirs are given back after."""
    held = clipping._installed[0]
    clipping._uninstall()
    clipping._installed[0] = 0
    yield
    clipping._uninstall()
    if held:
        clipping.install()
    clipping._installed[0] = held


def backward(model: torch.nn.Module, gen: torch.Generator) -> None:
    tokens = synthetic_batch(gen, batch=2, seq=8)
    lm_loss(model(tokens), tokens).backward()


def clipped_norm(params: list[torch.nn.Parameter]) -> float:
    """The gradients' L2 norm in float64, one parameter at a time."""
    return math.sqrt(sum(float(p.grad.double().square().sum()) for p in params
                         if p.grad is not None))


def test_the_wrapper_returns_and_clips_exactly_as_torch_and_goes_on_close() -> None:
    torch.manual_seed(0)
    model = TinyLM(dim=64, depth=2)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = normwatch.watch(model, opt, report_dir=None)
    assert torch.nn.utils.clip_grad_norm_ is not REAL
    assert torch.nn.utils.clip_grad.clip_grad_norm_ is not REAL
    for m in (model, twin):
        backward(m, torch.Generator().manual_seed(0))
    got = torch.nn.utils.clip_grad_norm_((p for p in model.parameters()), 0.5)
    want = REAL(twin.parameters(), 0.5)
    assert torch.equal(got, want)
    assert all(torch.equal(a.grad, b.grad) for a, b in
               zip(model.parameters(), twin.parameters(), strict=True))
    with pytest.warns(UserWarning, match="empty generator"):  # torch's own warning kept
        torch.nn.utils.clip_grad_norm_((p for p in []), 1.0)
    single = torch.nn.utils.clip_grad.clip_grad_norm_(model.head.weight, 1e9)
    assert torch.equal(single, torch.linalg.vector_norm(model.head.weight.grad))
    w.close()
    assert torch.nn.utils.clip_grad_norm_ is REAL
    assert torch.nn.utils.clip_grad.clip_grad_norm_ is REAL


@pytest.mark.parametrize("guarded", [False, True], ids=["monitor", "guard"])
def test_the_gradient_norm_is_the_clipped_one_and_not_read_again(
        guarded: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the loop clipping, the reported gradient norm is the exact norm after clipping
    (the sample's estimate is not exact), and neither the guard nor the monitor reads a
    gradient itself."""
    torch.manual_seed(0)
    model = TinyLM(dim=64, depth=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    w = normwatch.watch(model, opt, guard=guarded, flush_every=100, report_dir=None)

    def no_reading(*args: object) -> None:
        raise AssertionError("read the gradients again")

    monkeypatch.setattr(guard, "_sumsq", no_reading)
    monkeypatch.setattr(normwatch.measure.optimizer.updates, "_grad_sumsq", no_reading)
    monkeypatch.setattr(normwatch.measure.optimizer.updates, "_values", no_reading)
    gen = torch.Generator().manual_seed(0)
    exact = []
    for max_norm in (0.05, 1e9, 0.05):  # clipping active, inactive, active
        backward(model, gen)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        exact.append(clipped_norm(list(model.parameters())))
        opt.step()
        opt.zero_grad()
        w.step()
    got = [u.grad_norm for u in w.flush().updates]
    assert got == pytest.approx(exact, rel=1e-6)
    assert got[0] == pytest.approx(0.05, rel=1e-4)  # after clipping, not before
    w.close()


def test_a_norm_is_not_taken_for_gradients_that_changed_or_were_not_all_clipped() -> None:
    torch.manual_seed(0)
    model = TinyLM(dim=32, depth=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = clipping.install()
    try:
        gen = torch.Generator().manual_seed(0)
        backward(model, gen)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        taken = clipping.take(opt)
        assert taken is not None and bool(taken.finite)
        assert clipping.take(opt) is None  # taken once
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        backward(model, gen)  # accumulates into the clipped gradients: changed since
        assert clipping.take(opt) is None
        torch.nn.utils.clip_grad_norm_(list(model.parameters())[1:], 1.0)  # not every one
        assert clipping.take(opt) is None
        other = torch.nn.Linear(4, 4)
        other(torch.ones(1, 4)).sum().backward()
        torch.nn.utils.clip_grad_norm_([*model.parameters(), *other.parameters()], 1.0)
        assert clipping.take(opt) is None  # its norm covers another model's gradients
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=math.inf)
        taken = clipping.take(opt)  # the inf-norm says finite or not, not |g|
        assert taken is not None and taken.sumsq is None
        opt.zero_grad()  # no gradients at all
        assert clipping.take(opt) is None
        for _ in range(3 * clipping.KEEP):  # calls never taken do not pile up
            torch.nn.utils.clip_grad_norm_([torch.nn.Parameter(torch.ones(2))], 1.0)
        assert len(clipping._calls) <= clipping.KEEP
    finally:
        handle.remove()
    assert torch.nn.utils.clip_grad_norm_ is REAL and not clipping._calls


def test_the_guard_skips_a_step_whose_clipped_norm_is_nan() -> None:
    """A NaN gradient makes clip_grad_norm_ return NaN (and scale every gradient by it):
    the guard skips that step on that norm alone, the weights stay those of the run that
    never saw the batch."""
    torch.manual_seed(0)
    model = TinyLM(dim=32, depth=2)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    w = normwatch.watch(model, opt, guard=True, flush_every=100, report_dir=None)
    gens = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    for step in range(4):
        for m, o, gen in ((model, opt, gens[0]), (reference, ref_opt, gens[1])):
            backward(m, gen)
            if step == 2 and m is model:  # only the gradients: the norms saw nothing
                model.head.weight.grad[0, 0] = math.nan
            elif step == 2:
                o.zero_grad()
                continue
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            o.step()
            o.zero_grad()
        w.step()
    w.flush()
    assert [(e.step, e.reasons, e.skipped) for e in w.guard.events] == [
        (3, ("the optimizer's gradients",), True)]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(),
                                                 strict=True))
    w.close()


def test_a_failure_in_the_recording_warns_once_and_the_clip_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no record today")

    monkeypatch.setattr(clipping, "_record", broken)
    monkeypatch.setattr(clipping.part, "failed", None)
    model = TinyLM(dim=16, depth=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = normwatch.watch(model, opt, report_dir=None)
    backward(model, torch.Generator().manual_seed(0))
    want = clipped_norm(list(model.parameters()))
    with pytest.warns(RuntimeWarning, match="clip_grad_norm_") as caught:
        got = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    assert len([c for c in caught if "clip_grad_norm_" in str(c.message)]) == 1
    assert float(got) == pytest.approx(want, rel=1e-6)
    assert torch.nn.utils.clip_grad_norm_ is REAL  # switched off: torch's own again
    opt.step()  # the monitor reads the gradients itself
    w.step()
    (u,) = w.flush().updates
    assert u.grad_norm == pytest.approx(want, rel=5e-2)
    w.close()
    monkeypatch.setattr(clipping.part, "failed", None)


def test_clipping_inside_a_compiled_step_records_nothing_and_breaks_no_graph() -> None:
    model = TinyLM(dim=16, depth=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = normwatch.watch(model, opt, report_dir=None)
    backward(model, torch.Generator().manual_seed(0))
    grads = [p.grad.clone() for p in model.parameters()]

    @torch.compile(fullgraph=True, backend="eager")
    def clip(params: list[torch.nn.Parameter]) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, 0.1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        total = clip(list(model.parameters()))
    assert float(total) == pytest.approx(math.sqrt(sum(float(g.double().square().sum())
                                                       for g in grads)), rel=1e-5)
    assert clipping._calls == []
    w.close()


def test_a_lightning_trainer_that_clips_gives_its_norm_to_the_guard_and_the_monitor(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """``gradient_clip_val``: Lightning clips inside the closure the guarded step runs;
    the gradient norm of every step is the clipped one, and nothing reads the gradients
    a second time."""
    import lightning.pytorch as pl
    from normwatch.integrations.lightning import NormWatchCallback

    from tests.lightning_helpers import LitLM

    def no_reading(*args: object) -> None:
        raise AssertionError("read the gradients again")

    monkeypatch.setattr(guard, "_sumsq", no_reading)
    monkeypatch.setattr(normwatch.measure.optimizer.updates, "_values", no_reading)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    callback = NormWatchCallback(report_dir=None, guard=True, flush_every=3)
    t = pl.Trainer(callbacks=[callback], default_root_dir=str(tmp_path), accelerator="cpu",
                   devices=1, max_steps=6, gradient_clip_val=0.05, logger=False,
                   enable_progress_bar=False, enable_model_summary=False,
                   enable_checkpointing=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a part that failed would warn
        t.fit(LitLM())
    assert callback.watch is not None
    norms = [u.grad_norm for u in callback.watch.court.updates]
    assert len(norms) == 6 and norms == pytest.approx([0.05] * 6, rel=1e-4)
