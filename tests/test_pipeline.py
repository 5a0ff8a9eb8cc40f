"""A flush is one record handed to every sink through one protocol; a failing sink is
switched off with one warning and training goes on."""

from __future__ import annotations

import warnings

import pytest
import torch

import normwatch
from normwatch.demos.toymodel import TinyLM, lm_loss, synthetic_batch
from normwatch.errors import ConfigError
from normwatch.pipeline import Flush, Sink


class Recorder:
    def __init__(self, fail_at: int | None = None) -> None:
        self.flushes: list[Flush] = []
        self.exceptions: list[tuple[Flush, BaseException]] = []
        self.closed = 0
        self.fail_at = fail_at

    def on_flush(self, flush: Flush) -> None:
        if self.fail_at is not None and flush.snapshot.step >= self.fail_at:
            raise RuntimeError("sink down")
        self.flushes.append(flush)

    def on_exception(self, flush: Flush, exc: BaseException) -> None:
        self.exceptions.append((flush, exc))

    def close(self) -> None:
        self.closed += 1


def train(w: normwatch.Watch, model: TinyLM, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(steps):
        batch = synthetic_batch(torch.Generator().manual_seed(step))
        loss = lm_loss(model(batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        w.step(loss)


def test_each_flush_reaches_every_sink_as_one_record() -> None:
    model = TinyLM()
    w = normwatch.watch(model, flush_every=2, report_dir=None)
    sink = Recorder()
    assert isinstance(sink, Sink)
    w.add_sink(sink)
    assert w.sinks[-1] is sink
    train(w, model, 5)
    assert [(f.snapshot.step, f.regular, f.last) for f in sink.flushes] == [
        (2, True, False), (4, True, False)]
    first = sink.flushes[0]
    assert first.snapshot is w.court.history.records()[0].snapshot
    assert list(first.order) == w.forward_order and first.limits == w.config.limits
    assert first.ruling is not None and first.ruling.incident is None  # healthy
    assert set(first.trends) == {layer.name for layer in w.layers}
    assert len(first.rows) == len(w.layers)  # the raw rows, for combining across ranks
    w.finish()  # the tail (step 5) is judged and handed on; then every sink closes
    assert [(f.snapshot.step, f.last) for f in sink.flushes[2:]] == [(5, True)]
    assert sink.closed == 1 and w.last_flush is sink.flushes[-1]


def test_a_sink_that_raises_is_switched_off_with_one_warning() -> None:
    model = TinyLM()
    w = normwatch.watch(model, flush_every=2, report_dir=None)
    broken, fine = Recorder(fail_at=4), Recorder()
    w.add_sink(broken)
    w.add_sink(fine)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(w, model, 10)  # training goes on
    said = [c for c in caught if "the sink Recorder failed (RuntimeError: sink down)" in
            str(c.message)]
    assert len(said) == 1 and "switched off" in str(said[0].message)
    assert said[0].filename == __file__  # points at the training loop, not normwatch
    assert [f.snapshot.step for f in broken.flushes] == [2]
    assert [f.snapshot.step for f in fine.flushes] == [2, 4, 6, 8, 10]
    w.close()
    assert broken.closed == 0 and fine.closed == 1  # a switched-off sink is left alone


def test_an_exception_reaches_each_sink_with_the_court_s_ruling() -> None:
    model = TinyLM()
    sink = Recorder()
    with pytest.raises(ValueError, match="bad batch"), \
            normwatch.watch(model, flush_every=2, report_dir=None) as w:
        w.add_sink(sink)
        train(w, model, 3)
        raise ValueError("bad batch")
    [(flush, exc)] = sink.exceptions
    assert isinstance(exc, ValueError) and flush.last and not flush.regular
    assert flush.ruling is not None and flush.ruling.opened
    assert flush.ruling.incident is not None
    assert flush.ruling.incident.verdict.trigger == "exception"
    assert w.verdicts == [flush.ruling.incident.verdict]
    assert sink.closed == 1


def test_add_sink_refuses_what_is_not_a_sink() -> None:
    w = normwatch.watch(TinyLM(), report_dir=None)
    with pytest.raises(ConfigError, match=r"'sink' must have on_flush, on_exception and "
                                          r"close methods .*: got object"):
        w.add_sink(object())  # type: ignore[arg-type]
    w.close()
