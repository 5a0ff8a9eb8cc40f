"""NormWatchCallback in real Lightning Trainers: logging, accumulation, checkpoint/resume,
exceptions, RichProgressBar, and 2-process DDP."""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.loggers import CSVLogger
from normwatch.integrations.lightning import NormWatchCallback

import normwatch
from normwatch.report.document import load_report
from tests.lightning_helpers import LitLM

ROOT = Path(__file__).resolve().parents[2]


def trainer(tmp_path: Path, callback: NormWatchCallback, **kw: object) -> pl.Trainer:
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    options: dict[str, object] = dict(
        default_root_dir=str(tmp_path), accelerator="cpu", devices=1, max_steps=10,
        log_every_n_steps=5, logger=CSVLogger(str(tmp_path), name="logs"),
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    options.update(kw)
    return pl.Trainer(callbacks=[callback], **options)  # type: ignore[arg-type]


def csv_rows(tmp_path: Path) -> list[dict[str, str]]:
    path = next(tmp_path.glob("logs/version_*/metrics.csv"))
    with path.open() as f:
        return list(csv.DictReader(f))


def test_a_compiled_model_logs_the_eager_numbers_without_graph_breaks(tmp_path: Path) -> None:
    from torch._dynamo.utils import counters

    logged = {}
    for compiled in (False, True):
        torch.compiler.reset()
        counters.clear()
        callback = NormWatchCallback(report_dir=None, stats_every=1)
        t = trainer(tmp_path / str(compiled), callback, max_steps=6, log_every_n_steps=3)
        t.fit(LitLM(compile=compiled))
        logged[compiled] = [{k: float(v) for k, v in r.items() if k.startswith("normwatch/")
                             and v} for r in csv_rows(tmp_path / str(compiled))]
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"]
    eager, compiled_rows = logged[False], logged[True]
    assert len(eager) == len(compiled_rows) and any(r for r in eager)
    keys = set().union(*eager)  # the default: worst-layer summaries, no per-layer series
    assert "normwatch/absmax_max" in keys and len(keys) <= 13
    assert {"normwatch/grad_norm", "normwatch/update_norm", "normwatch/update_ratio"} <= keys
    assert not [k for k in keys if k.count("/") > 1 and not k.startswith("normwatch/alarms")]
    for want, got in zip(eager, compiled_rows, strict=True):
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    torch.compiler.reset()


def test_logs_through_the_trainer_logger_with_gradient_accumulation(tmp_path: Path) -> None:
    callback = NormWatchCallback(report_dir=str(tmp_path / "reports"), fp16_limit=64.0,
                                 log_layers=True)
    t = trainer(tmp_path, callback, accumulate_grad_batches=2)
    t.fit(LitLM())
    watch = callback.watch
    assert watch is not None and watch.closed  # hooks removed at teardown
    assert watch.step_count == t.global_step == 10  # one step per optimizer step
    assert watch.config.flush_every == 5  # from log_every_n_steps
    snap = watch.last_snapshot
    assert snap is not None and snap.layers["model.blocks.0.norm1"].calls == 10  # 5 x 2 micro
    rows = [r for r in csv_rows(tmp_path) if r.get("normwatch/model.norm/absmax")]
    assert [int(r["step"]) for r in rows] == [5, 10]
    assert float(rows[-1]["normwatch/model.norm/rms_mean"]) > 0
    assert rows[-1]["normwatch/alarms/critical"] == "0.0"
    absmax = float(rows[-1]["normwatch/model.norm/absmax"])  # headroom against the user's limit
    assert float(rows[-1]["normwatch/model.norm/fp16_headroom"]) == pytest.approx(64.0 / absmax)
    assert all(not m._forward_hooks for m in t.lightning_module.modules())
    # the trainer's optimizer was watched: one update per optimizer step, logged
    assert [u.step for u in watch.court.updates] == list(range(1, 11))
    assert float(rows[-1]["normwatch/update_norm"]) == watch.court.updates[-1].update_norm
    assert float(rows[-1]["normwatch/grad_norm"]) > 0
    assert not t.optimizers[0]._optimizer_step_pre_hooks  # removed at teardown


def test_the_steps_after_the_last_flush_are_judged_at_teardown(tmp_path: Path) -> None:
    """7 steps, a flush every 5: teardown ends the run as every integration does
    (``Watch.finish``), so steps 6-7 are read and judged, not dropped."""
    callback = NormWatchCallback(report_dir=None)
    t = trainer(tmp_path, callback, max_steps=7, logger=False)
    t.fit(LitLM())
    watch = callback.watch
    assert watch is not None and watch.closed
    snap = watch.last_snapshot
    assert snap is not None and (snap.first_step, snap.step) == (6, 7)
    assert snap.layers["model.norm"].calls == 2


def test_checkpoint_resume_keeps_the_watch_state(tmp_path: Path) -> None:
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=10)
    first = NormWatchCallback(report_dir=None, flush_every=1)
    t1 = pl.Trainer(default_root_dir=str(tmp_path), accelerator="cpu", max_steps=10,
                    callbacks=[first, ckpt], logger=False, enable_progress_bar=False,
                    enable_model_summary=False)
    t1.fit(LitLM())
    saved = first.state_dict()
    assert saved["step_count"] == 10 and len(saved["postmortem"]["spikes"]["losses"]) == 10
    path = next((tmp_path / "ckpt").glob("*.ckpt"))
    second = NormWatchCallback(report_dir=None, flush_every=1)
    t2 = pl.Trainer(default_root_dir=str(tmp_path), accelerator="cpu", max_steps=15,
                    callbacks=[second], logger=False, enable_progress_bar=False,
                    enable_model_summary=False)
    t2.fit(LitLM(), ckpt_path=str(path))
    assert second.watch is not None and second.watch.step_count == 15
    losses = second.state_dict()["postmortem"]["spikes"]["losses"]
    assert losses[:10] == saved["postmortem"]["spikes"]["losses"]  # baseline carried over
    assert len(losses) == 15


def test_exception_writes_a_post_mortem_and_removes_hooks(tmp_path: Path) -> None:
    callback = NormWatchCallback(report_dir=str(tmp_path / "reports"), flush_every=1)
    t = trainer(tmp_path, callback)
    module = LitLM(fail_at=4)
    with pytest.raises(RuntimeError, match="simulated crash"):
        t.fit(module)
    assert callback.watch is not None and callback.watch.closed
    report = load_report(callback.watch.reports[-1])
    assert report["trigger"] == "exception" and report["step"] == 3
    assert "simulated crash in training_step" in report["exception"]["traceback"]
    assert all(not m._forward_hooks for m in module.modules())


def test_ctrl_c_is_an_interrupt_not_a_fault(tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    callback = NormWatchCallback(report_dir=str(tmp_path / "reports"), flush_every=50)
    t = trainer(tmp_path, callback)
    module = LitLM(interrupt_at=4)
    sigint = signal.getsignal(signal.SIGINT)
    try:
        with caplog.at_level(logging.WARNING, logger="normwatch"), \
                pytest.raises(SystemExit):  # Lightning exits after its graceful shutdown
            t.fit(module)
    finally:
        signal.signal(signal.SIGINT, sigint)  # Lightning ignores further Ctrl-C
    watch = callback.watch
    assert watch is not None and watch.closed and watch.reports == [] and watch.verdicts == []
    assert all(not m._forward_hooks for m in module.modules())
    assert watch.last_snapshot is not None and watch.last_snapshot.step == 3
    assert any("[interrupted] KeyboardInterrupt at step 3: nothing abnormal" in r.getMessage()
               for r in caplog.records)


def test_rich_progress_bar_and_nan_verdict(tmp_path: Path) -> None:
    callback = NormWatchCallback(report_dir=str(tmp_path / "reports"), flush_every=1)
    t = pl.Trainer(
        default_root_dir=str(tmp_path), accelerator="cpu", max_steps=8, logger=False,
        callbacks=[callback, RichProgressBar()], enable_model_summary=False)
    t.fit(LitLM(nan_at=5))
    watch = callback.watch
    assert watch is not None and watch.config.report_console is False
    verdict = watch.verdicts[0]
    assert (verdict.trigger, verdict.step, verdict.blame) == (
        "nonfinite_activation", 5, "not_normalization")
    assert verdict.layer == "model.norm"
    replay = load_report(watch.reports[0])["replay"]  # 64 samples, batch 4: step 5 is
    assert replay["step"] == 5 and replay["position"] == {"epoch": 0, "batch_idx": 4}
    assert replay["batch_fingerprint"].startswith("int64[4x16]:")


def test_bad_options_fail_at_construction() -> None:
    with pytest.raises(normwatch.ConfigError, match="'flush_every' must be an int >= 1: got 0"):
        NormWatchCallback(flush_every=0)


@pytest.mark.slow
def test_two_process_ddp(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "ddp_run.py"), str(tmp_path)],
                            capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
                            check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    stats = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    for rank, s in stats.items():
        assert s["rank"] == rank and s["world_size"] == 2
        assert s["step_count"] == 8
        # each rank measures its own micro-batch (batch_size 4 per process, 16 tokens)
        assert s["tokens_per_flush"]["model.norm"] == 4 * 16
    assert stats[0]["first_batch_sum"] != stats[1]["first_batch_sum"]  # different shards
    # rank 1 breaks at step 6; rank 0 learns it at that very flush (one all_gather) ...
    assert stats[1]["verdicts"][0] == ["nonfinite_activation", 6, "not_normalization"]
    assert stats[0]["remote_verdicts"][0] == [1, "not_normalization", 6]
    # ... and is itself poisoned one step later through the all-reduced gradients
    assert stats[0]["verdicts"][0] == ["nonfinite_activation", 7, "not_normalization"]
    reports = sorted((tmp_path / "reports").iterdir(), key=lambda p: p.name.split("-step")[1])
    assert "step6-nonfinite_activation-rank1" in reports[0].name
    assert any(p.name.endswith("step7-nonfinite_activation-rank0") for p in reports)
    assert load_report(reports[0])["rank"] == 1
    rows = csv_rows(tmp_path)
    logged = [r for r in rows if r.get("normwatch/remote_verdicts")]
    steps = {int(r["step"]): float(r["normwatch/remote_verdicts"]) for r in logged}
    assert steps[5] == 0.0 and steps[6] == 1.0  # rank 0's logger shows rank 1's verdict


class ScaleProbe(pl.Callback):
    """Independent record of a 16-mixed run: each optimizer step's unscaled weight
    gradient of the final norm (float64), and the loss scale after each batch."""

    def __init__(self) -> None:
        self.grads: dict[int, float] = {}
        self.scales: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        grad = pl_module.model.norm.weight.grad  # unscaled by now
        self.grads[trainer.global_step + 1] = float(grad.double().norm())

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self.scales.append(float(trainer.precision_plugin.scaler.get_scale()))


def test_16_mixed_reads_the_grad_scaler(tmp_path: Path) -> None:
    from lightning.pytorch.plugins import MixedPrecision

    callback, probe = NormWatchCallback(stats_every=1, report_dir=None), ScaleProbe()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)  # overflows fp16 at first
    t = trainer(tmp_path, callback, max_steps=30, log_every_n_steps=10,
                plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    t.callbacks.append(probe)
    t.fit(LitLM())
    watch = callback.watch
    assert watch is not None and watch.step_count == 30  # skipped steps count too
    before = [2.0 ** 24, *probe.scales[:-1]]
    skipped = [i + 1 for i, (a, b) in enumerate(zip(before, probe.scales, strict=True)) if b < a]
    assert skipped and watch.skipped_steps == len(skipped)  # the scaler did skip some
    last = watch.last_snapshot
    assert last is not None and last.loss_scale == probe.scales[-1]
    assert not set(skipped) & set(range(last.first_step, last.step + 1))
    # the weight gradient as the optimizer saw it: RMS over the interval's steps, unscaled
    want = math.sqrt(sum(probe.grads[s] ** 2 for s in range(last.first_step, last.step + 1))
                     / (last.step - last.first_step + 1))
    assert last.layers["model.norm"].weight_grad_norm == pytest.approx(want, rel=1e-4)
    losses = [loss for _, loss in last.losses]
    assert len(losses) == 10 and all(0.5 < loss < 10.0 for loss in losses)  # unscaled


def test_the_guard_skips_poisoned_steps_and_keeps_the_last_good_checkpoint(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """NaN from step 5 on, guard_max_skips=3: steps 5-7 never reach the weights (the
    closure of automatic optimisation runs inside the guarded step), step 8 is applied;
    the checkpoints of steps 6-12 are refused and the one of step 4 stays."""
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    callback = NormWatchCallback(report_dir=None, guard=True, guard_max_skips=3)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2)
    t = pl.Trainer(callbacks=[callback, checkpoints], default_root_dir=str(tmp_path),
                   accelerator="cpu", devices=1, max_steps=12, log_every_n_steps=3,
                   logger=False, enable_progress_bar=False, enable_model_summary=False)
    module = LitLM(nan_at=5)
    with caplog.at_level(logging.WARNING, logger="normwatch"):
        t.fit(module)
    assert callback.watch is not None and callback.watch.guard is not None
    assert [(e.step, e.skipped) for e in callback.watch.guard.events] == [
        (5, True), (6, True), (7, True), *((s, False) for s in range(8, 13))]
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["epoch=0-step=4.ckpt"]
    state = torch.load(tmp_path / "ckpt" / "epoch=0-step=4.ckpt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values())
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith(
        "[guard] checkpoint of")]
    assert len(refusals) == 4 and "step=6.ckpt not written: an incident is open" in refusals[0]
    assert not all(torch.isfinite(p).all() for p in module.parameters())  # step 8 applied
    assert "save_checkpoint" not in vars(t)  # given back at teardown
