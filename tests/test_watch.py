"""Watch semantics: steps, flushes, close, bad input, crashes and interrupts."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import normwatch
from normwatch.demos.toymodel import TinyLM, lm_loss, synthetic_batch
from normwatch.report.document import load_report
from tests.conftest import tiny_hf


def train(model: nn.Module, w: normwatch.Watch, steps: int, accumulate: int = 1,
          batch: int = 4, seq: int = 16) -> None:
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        for _ in range(accumulate):
            tokens = synthetic_batch(gen, batch=batch, seq=seq)
            lm_loss(model(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()
        w.step()


def test_flush_every_and_token_counts() -> None:
    model = TinyLM(dim=32, depth=2)
    w = normwatch.watch(model, flush_every=3)
    snaps = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        tokens = synthetic_batch(gen, batch=4, seq=16)
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        snaps.append(w.step(loss))
    assert [s is not None for s in snaps] == [False, False, True] * 2
    snap = snaps[-1]
    assert snap is not None and (snap.first_step, snap.step) == (4, 6)
    assert [s for s, _ in snap.losses] == [4, 5, 6]
    assert list(snap.layers) == ["blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1",
                                 "blocks.1.norm2", "norm"]
    for stats in snap.layers.values():
        assert (stats.calls, stats.tokens, stats.finite_tokens) == (3, 3 * 64, 3 * 64)


def test_snapshot_values_match_float64_reference() -> None:
    norm = nn.LayerNorm(32)
    model = nn.Sequential(nn.Linear(8, 32), norm)
    inputs: list[torch.Tensor] = []
    norm.register_forward_hook(lambda m, a, o: inputs.append(a[0].detach().double()))
    w = normwatch.watch(model, flush_every=100)
    for _ in range(3):
        model(torch.randn(5, 8) * 10).sum().backward()
    stats = w.flush().layers["1"]
    x = torch.cat(inputs)
    var = x.var(-1, unbiased=False)
    rms = x.pow(2).mean(-1).sqrt()
    assert stats.absmax == pytest.approx(float(x.abs().max()), rel=1e-6)
    assert stats.rms_mean == pytest.approx(float(rms.mean()), rel=1e-5)
    assert stats.rms_min == pytest.approx(float(rms.min()), rel=1e-5)
    assert stats.eps_dominance == pytest.approx(float((1e-5 / (var + 1e-5)).max()), rel=1e-4)
    assert stats.sumsq_max == pytest.approx(float(x.pow(2).sum(-1).max()), rel=1e-5)


def test_flush_resets_the_interval() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    w = normwatch.watch(model)
    model(torch.randn(2, 4) * 1000).sum().backward()
    assert w.flush().layers["1"].absmax is not None
    empty = w.flush().layers["1"]
    assert (empty.calls, empty.tokens, empty.absmax) == (0, 0, None)


def test_gradient_accumulation_counts_every_micro_batch() -> None:
    model = TinyLM(dim=32, depth=1)
    w = normwatch.watch(model, flush_every=2)
    train(model, w, steps=2, accumulate=4)
    snap = w.last_snapshot
    assert snap is not None and snap.layers["norm"].calls == 8
    assert snap.layers["norm"].tokens == 8 * 4 * 16


def test_close_restores_the_model_exactly() -> None:
    model = tiny_hf("llama")
    tokens = torch.randint(0, 64, (2, 8))
    model.eval()
    before = model(tokens).logits
    hooks_before = {n: (dict(m._forward_hooks), dict(m._forward_hooks_with_kwargs),
                        dict(m._forward_pre_hooks)) for n, m in model.named_modules()}
    with normwatch.watch(model, count_eval=True) as w:
        assert len(w.layers) == 5
        monitored = model(tokens).logits
        assert any(m._forward_hooks for m in model.modules())
    w.close()  # harmless twice
    after = model(tokens).logits
    hooks_after = {n: (dict(m._forward_hooks), dict(m._forward_hooks_with_kwargs),
                       dict(m._forward_pre_hooks)) for n, m in model.named_modules()}
    assert torch.equal(before, monitored) and torch.equal(before, after)
    assert hooks_before == hooks_after


def test_options_are_validated() -> None:
    model = nn.LayerNorm(4)
    with pytest.raises(normwatch.ConfigError, match=r"'flush_every' must be an int >= 1: got 0"):
        normwatch.watch(model, flush_every=0)
    with pytest.raises(normwatch.ConfigError, match=r"unknown option 'flush_evry'; did you mean "
                       r"'flush_every'\?"):
        normwatch.watch(model, flush_evry=3)
    with pytest.raises(normwatch.ConfigError, match=r"'eps_tol' must be a finite number in "
                       r"\(0, 1\): got 2"):
        normwatch.watch(model, eps_tol=2)
    with pytest.raises(normwatch.ConfigError, match=r"'raise_on' must be one of .* got 'fatal'"):
        normwatch.watch(model, raise_on="fatal")
    with pytest.raises(normwatch.ConfigError, match=r"'sinks' must hold callables: got int"):
        normwatch.watch(model, sinks=[3])
    with pytest.raises(normwatch.ConfigError, match=r"'model' must be a torch.nn.Module: got str"):
        normwatch.watch("model")  # type: ignore[arg-type]
    scripted = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before any other word
        with pytest.raises(normwatch.ConfigError, match=r"'model' must be a Python nn.Module: "
                           r"got a TorchScript module \(RecursiveScriptModule\).*before "
                           r"torch.jit.script"):
            normwatch.watch(scripted)


def test_model_without_norms_warns_and_works() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.warns(RuntimeWarning, match="no normalization layers found in Sequential"):
        w = normwatch.watch(model)
    model(torch.randn(2, 4)).sum().backward()
    assert w.step() is None
    assert w.flush().layers == {}


def test_bad_loss_warns_once_and_training_goes_on() -> None:
    model = nn.LayerNorm(4)
    w = normwatch.watch(model, flush_every=2)
    with pytest.warns(RuntimeWarning, match=r"'loss' must be a scalar tensor or a number: got "
                      r"torch.float32 tensor of shape \(2,\) on cpu"):
        w.step(torch.ones(2))
    snap = w.step(0.5)
    assert snap is not None and snap.losses == ((2, 0.5),)


def test_repr_and_layers() -> None:
    w = normwatch.watch(TinyLM(dim=16, depth=1, heads=2))
    assert repr(w) == "<Watch 3 norm layers, step 0>"
    assert [layer.name for layer in w.layers] == ["blocks.0.norm1", "blocks.0.norm2", "norm"]


def test_meta_device_model() -> None:
    with torch.device("meta"):
        model = TinyLM(dim=16, depth=1, heads=2)
    with pytest.warns(RuntimeWarning, match="meta-device input"):
        w = normwatch.watch(model)
        model(torch.randint(0, 64, (2, 8), device="meta"))
    assert w.flush().layers["norm"].calls == 0
    assert w.disabled == {}


def test_state_dict_round_trip_keeps_steps_and_loss_baseline() -> None:
    import json

    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    w = normwatch.watch(model, flush_every=1, spike_warmup=5, report_dir=None)
    for i in range(20):
        model(torch.randn(2, 4)).sum().backward()
        w.step(1.0 + 0.01 * (i % 3))
    state = json.loads(json.dumps(w.state_dict()))
    w.close()
    resumed = normwatch.watch(model, flush_every=1, spike_warmup=5, report_dir=None)
    resumed.load_state_dict(state)
    assert resumed.step_count == 20
    snap = resumed.step(5.0)  # judged against the restored baseline: a spike at step 21
    assert snap is not None and snap.step == 21
    assert [(v.trigger, v.step) for v in resumed.verdicts] == [("loss_spike", 21)]
    with pytest.raises(normwatch.ConfigError, match="'state' must be a normwatch state dict"):
        resumed.load_state_dict({"version": 7})


def test_set_step_continues_the_numbering_of_events() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    w = normwatch.watch(model, flush_every=1, report_dir=None)
    w.set_step(100)  # resuming after 100 completed steps
    model(torch.full((2, 4), float("nan"))).sum().backward()
    snap = w.step()
    assert snap is not None and (snap.first_step, snap.step) == (101, 101)
    assert snap.first_nonfinite is not None and snap.first_nonfinite.step == 101


def test_a_failing_fold_drops_its_measurements_with_one_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from normwatch.measure.backends.native.backend import NativeBackend

    model = TinyLM(dim=32, depth=1)
    w = normwatch.watch(model, flush_every=2, report_dir=None)
    real = NativeBackend.fold  # (the backend of CPU tensors: what folds the step's calls)

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("fold exploded")

    monkeypatch.setattr(NativeBackend, "fold", broken)
    with pytest.warns(RuntimeWarning, match="folding the step's statistics failed") as record:
        train(model, w, steps=4)  # two flushes, two failed folds
    assert sum("folding" in str(r.message) for r in record) == 1
    assert w.flushes == 2 and w.disabled == {}
    monkeypatch.setattr(NativeBackend, "fold", real)
    train(model, w, steps=2)
    snap = w.last_snapshot
    assert snap is not None and snap.layers["norm"].finite_tokens == 2 * 4 * 16


def test_forward_only_loops_keep_staged_rows_bounded() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16)).eval()
    w = normwatch.watch(model, count_eval=True, report_dir=None)
    acc = w._measure.accumulator
    acc.max_staged_tokens = 64
    with torch.no_grad():
        for _ in range(300):  # evaluation without watch.step(): folds as rows pile up
            model(torch.randn(5, 8))
            assert len(acc._staged) * 5 < 64
    snap = w.flush()
    assert (snap.layers["1"].calls, snap.layers["1"].tokens) == (300, 1500)
    assert snap.layers["1"].finite_tokens == 1500


def crash_run(tmp_path: Path, flush_every: int, nan_at: int | None, stop_at: int,
              exc: BaseException) -> normwatch.Watch:
    """Train TinyLM, NaN from block 1's MLP from ``nan_at``, ``exc`` raised in step
    ``stop_at`` after its forward, inside ``with watch:``."""
    model = TinyLM(dim=32, depth=2)
    w = normwatch.watch(model, flush_every=flush_every, report_dir=str(tmp_path / "r"),
                        report_console=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(type(exc)), w:
        for step in range(1, stop_at + 1):
            model.blocks[1].mlp.fault = nan_at is not None and step >= nan_at
            tokens = synthetic_batch(gen, batch=2, seq=8)
            loss = lm_loss(model(tokens), tokens)
            if step == stop_at:
                raise exc
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss)
    return w


@pytest.mark.parametrize("flush_every", [10, 50])
def test_a_crash_between_flushes_is_judged_on_every_step_up_to_it(tmp_path: Path,
                                                                  flush_every: int) -> None:
    w = crash_run(tmp_path, flush_every, nan_at=15, stop_at=16, exc=RuntimeError("crash"))
    assert w.closed and len(w.reports) == 1  # one report: the exception's, not a second
    report = load_report(w.reports[0])
    assert (report["trigger"], report["step"]) == ("exception", 15)
    assert report["first_nonfinite"] == {"step": 15, "layer": "norm", "position": 4,
                                         "origin": "input"}
    verdict = report["verdict"]
    assert (verdict["blame"], verdict["layer"], verdict["cause"]) == (
        "not_normalization", "norm", "nonfinite")
    assert "between blocks.1.norm2 and norm" in verdict["block"]
    assert report["loss_history"][-1] == [15, "nan"]


def test_a_crash_before_the_first_flush_is_judged_on_its_steps(tmp_path: Path) -> None:
    w = crash_run(tmp_path, 10, nan_at=None, stop_at=3, exc=ValueError("bad batch"))
    report = load_report(w.reports[0])
    assert report["verdict"]["blame"] == "not_normalization"
    assert report["verdict"]["evidence"][0].startswith("All 5 norm layers stayed healthy")
    assert [s for s, _ in report["loss_history"]] == [1, 2]
    # steps 1-2 and the interrupted forward of step 3
    assert {layer["history"][-1]["tokens"] for layer in report["layers"]} == {48}


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(1)])
def test_an_interrupt_is_not_a_fault(tmp_path: Path, exc: BaseException,
                                     caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="normwatch"):
        w = crash_run(tmp_path, 10, nan_at=None, stop_at=4, exc=exc)
    assert w.closed and w.verdicts == [] and w.reports == []
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())
    lines = [r.getMessage() for r in caplog.records if "[interrupted]" in r.getMessage()]
    assert lines == [f"[interrupted] {type(exc).__name__} at step 3: nothing abnormal in the "
                     "norms since the last report; no post-mortem"]
    assert w.last_snapshot is not None and w.last_snapshot.step == 3  # the interval was read


def test_an_interrupt_after_a_fault_reports_the_fault(tmp_path: Path) -> None:
    w = crash_run(tmp_path, 10, nan_at=5, stop_at=7, exc=KeyboardInterrupt())
    assert [(v.trigger, v.layer) for v in w.verdicts] == [("nonfinite_activation", "norm")]
    assert load_report(w.reports[0])["trigger"] == "nonfinite_activation"


def test_use_after_close_warns_once() -> None:
    model = nn.LayerNorm(4)
    w = normwatch.watch(model, report_dir=None)
    w.close()
    with pytest.warns(RuntimeWarning, match=r"step\(\) after close\(\)"):
        assert w.step() is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert w.flush().layers == {}
        w.step()
    assert caught == []


@pytest.mark.parametrize(("where", "message"), [
    ("file", "'report_dir' must be a folder: got .*, which is a file"),
    ("file/reports", "'report_dir' must be a folder normwatch can create: got .*file/reports"),
])
def test_a_bad_report_dir_fails_when_the_watch_starts(tmp_path: Path, where: str,
                                                      message: str) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(normwatch.ConfigError, match=message):
        normwatch.watch(nn.LayerNorm(4), report_dir=str(tmp_path / where))
    w = normwatch.watch(nn.LayerNorm(4), report_dir=str(tmp_path / "new" / "reports"))
    assert (tmp_path / "new" / "reports").is_dir()  # created at the start
    w.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU driver")
def test_kernel_triton_without_a_backend_fails_at_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(normwatch.ConfigError, match="'kernel' is 'triton' but no GPU driver"):
        normwatch.watch(nn.LayerNorm(4), kernel="triton")
    normwatch.watch(nn.LayerNorm(4), kernel="auto").close()  # auto picks torch here


def test_watching_a_watched_model_is_refused() -> None:
    model = TinyLM(dim=16, depth=1)
    first = normwatch.watch(model, report_dir=None)
    with pytest.raises(normwatch.ConfigError, match=r"'model' \(Block\) is already watched by "
                                                    r"<Watch 3 norm layers"):
        normwatch.watch(model.blocks[0], report_dir=None)  # a part of it counts too
    first.close()
    normwatch.watch(model, report_dir=None).close()  # after close(): fine


@pytest.mark.parametrize("mode", ["eval", "no_grad", "never called"])
def test_a_first_interval_with_nothing_measured_warns_why(mode: str) -> None:
    model, other = TinyLM(dim=16, depth=1), TinyLM(dim=16, depth=1)
    w = normwatch.watch(model, report_dir=None, flush_every=2)
    tokens = synthetic_batch(torch.Generator().manual_seed(0), batch=2, seq=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):  # two flushes: one warning
            if mode == "eval":
                model.eval()
                model(tokens)
            elif mode == "no_grad":
                with torch.no_grad():
                    model(tokens)
            else:
                other(tokens)
            w.step()
    w.close()
    said = [str(c.message) for c in caught if "nothing was measured" in str(c.message)]
    assert len(said) == 1, said
    assert "nothing was measured in the first 2 steps of TinyLM" in said[0]
    want = {"eval": "6 norm calls in eval mode and 0 without grad",
            "no_grad": "0 norm calls in eval mode and 6 without grad",
            "never called": "no norm layer was called at all"}[mode]
    assert want in said[0]


def test_an_exception_before_any_measurement_says_so(tmp_path: Path) -> None:
    w = normwatch.watch(TinyLM(dim=16, depth=2), report_dir=str(tmp_path))
    w.step()
    verdict = w.report_exception(RuntimeError("data loader died"))
    w.close()
    assert verdict is not None and verdict.blame == "inconclusive"
    assert verdict.evidence[0].startswith("No norm call was measured before the exception at "
                                          "step 1 (none of the 5 norm layers")


def test_console_prints_attach_verdict_and_exit_lines(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    model = TinyLM(dim=16, depth=1)
    w = normwatch.watch(model, console="lines", report_dir=str(tmp_path), report_console=False,
                        flush_every=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step in range(1, 5):
            model.blocks[0].mlp.fault = step >= 3
            tokens = synthetic_batch(torch.Generator().manual_seed(step), batch=2, seq=8)
            w.step(lm_loss(model(tokens), tokens))
    w.close()
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("normwatch: watching TinyLM: 3 norm layers (3 RMSNorm), flush every 2 "
                      f"steps, reports to {tmp_path}")
    verdicts = [line for line in err if line.startswith("normwatch VERDICT")]
    assert len(verdicts) == 1 and "at step 3: normalization" not in verdicts[0]
    assert err[-1].startswith("normwatch: TinyLM: 4 steps watched; alarms: ")
    assert "verdicts: 1" in err[-1] and str(tmp_path) in err[-1]
    assert all(len(line) < 400 for line in err)  # one line each, never wrapped


def test_a_skipped_step_counts_and_its_gradients_are_dropped() -> None:
    torch.manual_seed(0)
    model = TinyLM(dim=16, depth=1)
    w = normwatch.watch(model, report_dir=None, stats_every=1, flush_every=2)
    tokens = synthetic_batch(torch.Generator().manual_seed(0), batch=2, seq=8)
    lm_loss(model(tokens), tokens).backward()
    w.step(skipped=False)
    (lm_loss(model(tokens), tokens) * 1e30).backward()  # as if scaled past fp16
    snap = w.step(skipped=True)
    w.close()
    assert snap is not None and w.step_count == 2 and w.skipped_steps == 1
    norm = snap.layers["norm"]
    assert norm.weight_grad_norm is not None and norm.weight_grad_norm < 1e3  # step 1's only


@pytest.mark.parametrize("kernel", ["auto", "torch"], ids=["C++ lane", "Python hook"])
def test_a_watched_model_saves_whole_and_loads_unwatched(kernel: str, tmp_path: Path) -> None:
    """``torch.save(model)`` of a watched, trained model (its optimizer watched too) warns
    nothing and the watch goes on; a fresh process loads it with no watch: its outputs
    are the model's bit for bit, and normwatch's hooks on it do nothing."""
    torch.manual_seed(0)
    model = TinyLM(dim=32, depth=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = normwatch.watch(model, opt, kernel=kernel, report_dir=None, stats_every=1)
    tokens = synthetic_batch(torch.Generator().manual_seed(0), batch=2, seq=8)

    def step() -> None:
        lm_loss(model(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()
        w.step()

    step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.save(model, tmp_path / "model.pt")
    with torch.no_grad():
        torch.save({"tokens": tokens, "expected": model(tokens)}, tmp_path / "io.pt")
    step()
    assert all(s.calls == 2 and s.grad_out_rms is not None for s in w.flush().layers.values())
    w.close()
    code = ("import sys, torch\n"
            "model = torch.load(sys.argv[1], weights_only=False)\n"
            "io = torch.load(sys.argv[2])\n"
            "with torch.no_grad():\n"
            "    out = model(io['tokens'])\n"
            "hooks = [h for m in model.modules() for d in (m._forward_hooks, "
            "m._forward_pre_hooks) for h in d.values()]\n"
            "print(torch.equal(out, io['expected']), len(hooks), "
            "*sorted({type(h).__name__ for h in hooks}))\n")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "model.pt"),
                             str(tmp_path / "io.pt")], capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.stdout.split() == ["True", "5", "Unwatched"], result.stderr[-2000:]
