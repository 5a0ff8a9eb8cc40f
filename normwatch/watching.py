"""The :class:`Watch`: orchestrates measurement, judgement, reports and export.

    >>> watch = normwatch.watch(model, flush_every=10)
    >>> for batch in data:
    ...     loss = model(batch).loss
    ...     loss.backward(); optimizer.step(); optimizer.zero_grad()
    ...     watch.step(loss)          # flushes every 10 steps, raises alarms
    >>> watch.close()                 # the model is exactly as before
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from normwatch._version import __version__
from normwatch.config import WatchConfig
from normwatch.errors import ConfigError, NumericalHealthError
from normwatch.judge.alarms import RuleContext, evaluate
from normwatch.judge.court import Court, Ruling
from normwatch.judge.dedup import Dedup, fatal
from normwatch.judge.depth import DepthProfile, depth_profile
from normwatch.judge.guarding import guard_alarms
from normwatch.judge.history import Trends
from normwatch.measure.backends.triton_kernel import available as triton_available
from normwatch.measure.backends.triton_kernel import usable as triton_usable
from normwatch.measure.layer.compiling import compiled_code, guard_hooks, keep_traced_writes
from normwatch.measure.measurement import Measurement
from normwatch.measure.model.discovery import iter_norm_modules
from normwatch.measure.optimizer import clipping
from normwatch.measure.optimizer.guard import StepGuard
from normwatch.measure.optimizer.updates import UpdateMonitor
from normwatch.measure.state.grad_fold import unscale
from normwatch.measure.step.losses import LossBuffer, ride_along
from normwatch.pipeline import Flush, Sink, Sinks
from normwatch.records import Alarm, GuardEvent, NormLayer, ReplayPoint, Snapshot, Verdict
from normwatch.report.dispatch import AlarmLog
from normwatch.report.document import device_name, prepare_report_dir
from normwatch.report.lines import attach_line, exit_line
from normwatch.report.postmortem import ReportWriter

if TYPE_CHECKING:
    from normwatch.export.prometheus import MetricsEndpoint, NormwatchCollector
    from normwatch.measure.step.early import EarlyWarning
    from normwatch.report.live import ConsoleView

HISTORY_POINTS = 16

_LIVE: weakref.WeakSet[Watch] = weakref.WeakSet()
"""Watches not yet closed (:func:`watched_by`)."""


def watched_by(model: nn.Module) -> Watch | None:
    """The open watch that already measures a norm of ``model``, if any."""
    mods = {id(m) for m in model.modules()}
    for w in list(_LIVE):
        if not w.closed and any(id(m) in mods for m in w._measure.modules):
            return w
    return None


class Watch:
    """Monitor of a model's normalization layers. Build it with :func:`normwatch.watch`."""

    def __init__(self, model: nn.Module, config: WatchConfig | None = None, *,
                 drop_compiled: bool = True) -> None:
        """``drop_compiled``: when ``model`` has compiled code, reset torch.compile's caches
        so that it recompiles with the hooks (``normwatch run`` attaches before the first
        training forward: what was compiled before it counts nothing)."""
        if not isinstance(model, nn.Module):
            raise ConfigError(f"'model' must be a torch.nn.Module: got {type(model).__name__}")
        if isinstance(model, torch.jit.ScriptModule):
            raise ConfigError(f"'model' must be a Python nn.Module: got a TorchScript module "
                              f"({type(model).__name__}), which runs no Python hooks; watch "
                              "the module before torch.jit.script or torch.jit.trace")
        self.config = c = config or WatchConfig()
        if c.kernel == "triton" and not triton_usable():
            why = "no GPU driver is up (and TRITON_INTERPRET is not set)" \
                if triton_available() else "Triton does not import here"
            raise ConfigError(f"'kernel' is 'triton' but {why}: use kernel='auto' (the fused "
                              "kernel where it can run, torch elsewhere) or 'torch'")
        if c.report_dir is not None:
            prepare_report_dir(c.report_dir)
        pairs = list(iter_norm_modules(model, c.include, c.exclude))
        owner = watched_by(model) if pairs else None
        if owner is not None:
            raise ConfigError(f"'model' ({type(model).__name__}) is already watched by {owner!r}: "
                              "close() that watch first (two watches would measure every norm "
                              "twice)")
        if pairs:
            guard_hooks()
            keep_traced_writes()
        stale = compiled_code(model) if pairs and drop_compiled else []
        if stale:
            warnings.warn(
                f"normwatch: {type(model).__name__} (or another model of its classes) was "
                f"compiled before watch() (compiled code for {', '.join(stale)}), and that "
                "code never runs hooks added later; resetting torch.compile's caches "
                "(torch.compiler.reset()) so the next call recompiles with them. Attach "
                "before the first compiled call to avoid the recompile", RuntimeWarning,
                stacklevel=3)
            torch.compiler.reset()
        if not pairs:
            warnings.warn(
                f"normwatch: no normalization layers found in {type(model).__name__}"
                + (" matching include/exclude" if c.include or c.exclude else "")
                + "; nothing will be measured (custom norms: normwatch.register_norm)",
                RuntimeWarning,
                stacklevel=3,
            )
        view = None
        if c.console is not None:  # first: a first run says what it builds
            from normwatch.report.live import ConsoleView

            view = ConsoleView(live=None if c.console == "live" else False)
        self._measure = Measurement(pairs, c.limits, count_eval=c.count_eval, kernel=c.kernel,
                                    root=model, output_checks=c.output_check_every > 0,
                                    gradients=c.gradients, poison=c.guard)
        self.layers: tuple[NormLayer, ...] = self._measure.layers
        self._by_name = {layer.name: layer for layer in self.layers}
        self._dedup = Dedup()
        self.court = Court(c)
        """Triggers, verdicts, incidents and the record they rest on."""
        self._log = AlarmLog(c)
        self._writer = ReportWriter(c, self.layers, self.court, self._dedup.history,
                                    self._devices)
        self._sinks = Sinks()
        self._added: list[Sink] = []
        self.run_id = c.run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self._collector: NormwatchCollector | None = None
        self.endpoint: MetricsEndpoint | None = None
        """The HTTP endpoint serving :attr:`collector` (with ``prometheus_port``)."""
        self._early: EarlyWarning | None = None
        if c.prometheus_aggregate:
            self.collector  # noqa: B018 - made now: every rank must join the flush's collective
        if c.prometheus_port is not None:
            from normwatch.export.prometheus import MetricsEndpoint

            endpoint = MetricsEndpoint(self.collector, self.run_id, c.rank)
            if endpoint.serve(c.prometheus_port, c.prometheus_addr, c.prometheus_certfile,
                              c.prometheus_keyfile):
                self.endpoint = endpoint
        self._trends = Trends([layer.name for layer in self.layers], HISTORY_POINTS)
        self._losses = LossBuffer()
        self.guard: StepGuard | None = StepGuard(
            self._measure.poisoned, lambda: self.step_count + 1, c.guard_max_skips,
            staged=self._measure.step_rows, kernel=c.kernel) if c.guard else None
        """With ``guard=True``: what keeps poisoned steps from the weights (its ``events``:
        every poisoned step)."""
        self._updates = UpdateMonitor(
            lambda: self.step_count + 1, full=lambda: self._measure.full_stats,
            exact=clipping.sumsq if self.guard is None else self.guard.grad_sumsq,
            kernel=c.kernel)
        self._clipping: clipping.Handle | None = None
        """The loop's ``clip_grad_norm_`` norms, read while an optimizer is watched."""
        self.step_count = 0
        self._interval_start = 1
        self.flushes = 0
        self.last_flush: Flush | None = None
        """What the last flush measured and decided."""
        self._last_check: list[Alarm] = []
        self.closed = False
        self._warned_closed = False
        self.view: ConsoleView | None = view
        """Where the console output goes (``console`` option; assign your own)."""
        self._scaler: object = None
        self.skipped_steps = 0
        """Steps whose optimizer step a loss scaler skipped (``step(skipped=True)``)."""
        self._model_name = type(model).__name__
        self._model = weakref.ref(model)
        self._idle_checked = False
        _LIVE.add(self)
        if view is not None:
            view.note(attach_line(self._model_name, self.layers, c.flush_every,
                                       c.report_dir))

    # -- the training-loop API ------------------------------------------------------------

    def step(self, loss: Any = None, skipped: bool = False) -> Snapshot | None:
        """Mark the end of an optimizer step; flush every ``flush_every`` steps.

        ``loss`` (a scalar tensor or number, unscaled) is kept on its device until the
        flush. ``skipped``: a loss scaler (``GradScaler``) skipped this step's optimizer
        step for inf/NaN gradients, as it is meant to; the step counts, its gradients are
        not measured (they were scaled past fp16). Returns the snapshot when this step
        flushed, else ``None``.
        """
        if self._closed_use("step"):
            return None
        self._measure.discard_interrupted()
        if skipped:
            self.skipped_steps += 1
            self._measure.drop_step_gradients()
            logging.getLogger(self.config.logger).info(
                "[loss scaler] step %d skipped by the loss scaler (inf/NaN gradients, the "
                "scale is lowered): expected with fp16 loss scaling, not a fault",
                self.step_count + 1)
        self.step_count += 1
        self._losses.record(loss, self.step_count)
        if self.config.early_warning and (self._early is not None or self._measure.on_cuda()):
            # the early-warning peek reads the folded state every step
            self._measure.commit(step_over=True)
        regular = self.step_count % self.config.flush_every == 0
        early = self._early_check(launch=not regular)
        self._measure.begin_step(self.step_count + 1,
                                 full=self.step_count % self.config.stats_every == 0)
        if early or regular:
            return self._flush(regular=regular).snapshot
        return None

    def _early_check(self, launch: bool = True) -> bool:
        """Poll the last in-flight peek (no stall), launch the next (``launch``: not on a
        step that flushes: the flush reads it all); ``True``: flush now."""
        if not self.config.early_warning or (self._early is None and
                                             not self._measure.on_cuda()):
            return False  # (the CPU's blocks are peeked only beside a CUDA one's)
        blocks = {d: b for d, b in self._measure.blocks.items()
                  if d.type == "cuda" or self._early is not None}
        if not blocks:
            return False
        if self._early is None:
            from normwatch.measure.step.early import EarlyWarning

            self._early = EarlyWarning(self.config.limits.fp16_limit)
        trouble = self._early.poll()
        if launch:
            self._early.launch(blocks)
        return bool(trouble)

    def flush(self) -> Snapshot:
        """Copy the interval's statistics to the host (the only sync), reset, run alarms."""
        if self._closed_use("flush"):
            return Snapshot(self.step_count, self._interval_start, {})
        return self._flush().snapshot

    @property
    def unflushed(self) -> bool:
        """Whether steps or norm calls were measured since the last flush."""
        return self.step_count >= self._interval_start or self._measure.pending

    def _flush(self, *, regular: bool = False, last: bool = False,
               conclude: bool = True) -> Flush:
        """Read, judge, hand the :class:`~normwatch.pipeline.Flush` to the sinks, raise
        per ``raise_on``. ``regular``: at the ``flush_every`` cadence (every rank is
        here); ``last``: the run's end or crash (no raising); ``conclude``: judge the
        triggers (else only record the interval)."""
        checked = self._measure.checking_outputs
        snapshot, rows, (before, guarded) = self._read()  # the only device -> host copy
        self._trends.record(snapshot)
        profile = depth_profile(snapshot, self.forward_order, self.config.placement)
        findings = evaluate(snapshot, self._context(snapshot, profile)) + \
            guard_alarms(guarded, snapshot.step, self.config.guard_max_skips, before)
        if checked:
            self._last_check = [a for a in findings if a.kind == "output_mismatch"]
        passed, lines = self._dedup.sift(findings, self.forward_order)
        ruling = self.court.hear(snapshot, findings, passed, self.forward_order, profile,
                                 conclude)
        flush = self.last_flush = self._record(snapshot, ruling, findings, passed, lines,
                                               profile, rows, regular=regular, last=last)
        self._sinks.flush(self.sinks, flush)
        if not last:
            self._warn_if_idle(snapshot)
            if stop := fatal(passed, self.config.raise_on):
                raise NumericalHealthError(stop)
        return flush

    def _read(self) -> tuple[Snapshot, list[dict[str, float]],
                             tuple[GuardEvent | None, list[GuardEvent]]]:
        """The interval's snapshot, each layer's raw row and the guard's new events (with
        the one before them) from one copy per device (losses, optimizer steps, guard rows,
        batch fingerprints and the loss scale ride along); then a new interval."""
        if self._early is not None:
            self._early.reset()
        scale = getattr(self._scaler, "_scale", None)
        scale = scale if isinstance(scale, torch.Tensor) else None
        scales = {} if scale is None else {scale.device: scale}
        guard_rows = {} if self.guard is None else self.guard.tensors()
        replay = self._measure.replay
        rows, copied = self._measure.read(ride_along(
            self._losses.tensors(), self._updates.tensors(), guard_rows, replay.tensors(),
            scales))
        values = {d: iter(v) for d, v in copied.items()}  # in the order they rode along
        losses, updates = self._losses.resolve(values), self._updates.resolve(values)
        guarded = (None, []) if self.guard is None else self.guard.resolve(values)
        replay.resolve(values)
        loss_scale = None if scale is None else next(values[scale.device])
        if loss_scale is not None:
            unscale(rows, loss_scale)
        snapshot = self._measure.snapshot(rows, self.step_count, self._interval_start,
                                          losses, updates)
        if loss_scale is not None:
            snapshot = dataclasses.replace(snapshot, loss_scale=loss_scale)
        self.flushes += 1
        every = self.config.output_check_every
        self._measure.reset(check_outputs=every > 0 and self.flushes % every == 0)
        self._losses.clear()
        self._interval_start = self.step_count + 1
        return snapshot, rows, guarded

    def _context(self, snapshot: Snapshot, profile: DepthProfile | None) -> RuleContext:
        return RuleContext(self.config, self._by_name, self._measure.probes(snapshot),
                           self._trends.absmax_points(), self.forward_order,
                           tuple(self._trends.gradients), profile)

    def _record(self, snapshot: Snapshot, ruling: Ruling | None,
                findings: Sequence[Alarm] = (), passed: Sequence[Alarm] = (),
                lines: Sequence[Alarm] = (), profile: DepthProfile | None = None,
                rows: Sequence[Mapping[str, float]] = (), *, regular: bool = False,
                last: bool = False) -> Flush:
        current = {(a.kind, a.layer) for a in findings}
        health = [*findings, *(a for a in self._last_check if (a.kind, a.layer) not in current)]
        return Flush(snapshot, tuple(findings), tuple(passed), tuple(lines), ruling,
                     tuple(self.alarms), tuple(self.verdicts), tuple(health),
                     tuple(self.forward_order), self.config.placement, self.config.limits,
                     profile, self._trends.sparklines(),
                     None if self.guard is None else tuple(self.guard.events),
                     self._replay_point(ruling), tuple(rows), regular, last)

    def _replay_point(self, ruling: Ruling | None) -> ReplayPoint | None:
        """What re-runs the first step of the incident ``ruling`` touched."""
        if ruling is None or ruling.incident is None:
            return None
        return self._measure.replay.at(ruling.incident.first_step)

    def note_batch(self, batch: object) -> None:
        """The step under way's batch, before its forward (the Lightning callback calls
        it; plain loops need not: the model's first forward is seen): its integer
        tensors are fingerprinted on the device, the RNG states noted."""
        self._measure.replay.forward((batch,), {})

    def note_position(self, **position: int | float | str) -> None:
        """Record where the data loader stands for the step under way (the trainer
        callbacks call it: Lightning's ``epoch`` and ``batch_idx``, Hugging Face's
        ``global_step`` and ``epoch``); a post-mortem's ``replay`` section carries it."""
        self._measure.replay.note(**position)

    def _across_ranks(self, flush: Flush) -> Flush:
        """``flush`` with every rank's raw rows combined (one collective)."""
        from normwatch.export.crossrank import combine_ranks

        s = flush.snapshot
        shared = self._measure.snapshot(combine_ranks(flush.rows), s.step, s.first_step,
                                        s.losses, s.updates)
        return dataclasses.replace(flush, snapshot=shared, profile=depth_profile(
            shared, flush.order, flush.placement))

    @property
    def sinks(self) -> list[Sink]:
        """Where each flush goes, in order: the log, the console, the post-mortem writer,
        the Prometheus collector (once made), then those added with :meth:`add_sink`."""
        view: list[Sink] = [] if self.view is None else [self.view]
        collector: list[Sink] = [] if self._collector is None else [self._collector]
        return [self._log, *view, self._writer, *collector, *self._added]

    def add_sink(self, sink: Sink) -> None:
        """Hand every later flush to ``sink`` too (``on_flush``, ``on_exception``,
        ``close``: :class:`normwatch.pipeline.Sink`); a sink that raises is switched off
        with one warning."""
        if not isinstance(sink, Sink):
            raise ConfigError(f"'sink' must have on_flush, on_exception and close methods "
                              f"(normwatch.pipeline.Sink): got {type(sink).__name__}")
        self._added.append(sink)

    def _warn_if_idle(self, snapshot: Snapshot) -> None:
        """After the first flush: one warning if no norm call was measured, saying why."""
        if self._idle_checked:
            return
        self._idle_checked = True
        if not self.layers or any(s.calls for s in snapshot.layers.values()):
            return
        eval_calls, no_grad = self._measure.uncounted()
        if eval_calls or no_grad:
            why = (f"{eval_calls} norm calls in eval mode and {no_grad} without grad were "
                   "seen (count_eval=True measures those)")
        else:
            why = "no norm layer was called at all (is this the model that trains?" + \
                  (" check include/exclude" if self.config.include or self.config.exclude
                   else "") + ")"
        steps = f"the first {snapshot.step} steps" if snapshot.step > 1 else \
            "the first step" if snapshot.step == 1 else "the forwards before the first step"
        warnings.warn(f"normwatch: nothing was measured in {steps} of {self._model_name}: "
                      f"{why}", RuntimeWarning, stacklevel=4)

    @property
    def last_snapshot(self) -> Snapshot | None:
        """The last flush's snapshot."""
        return None if self.last_flush is None else self.last_flush.snapshot

    @property
    def last_findings(self) -> list[Alarm]:
        """The rules' findings at the last flush, before de-duplication."""
        return [] if self.last_flush is None else list(self.last_flush.findings)

    @property
    def health_findings(self) -> list[Alarm]:
        """The last flush's findings and, when that flush did not check outputs (every
        ``output_check_every`` flushes), the last output check's: what a layer's health
        rests on."""
        return [] if self.last_flush is None else list(self.last_flush.health)

    @property
    def collector(self) -> NormwatchCollector:
        """The Prometheus collector of this watch (made on first use, from the flushes
        kept so far); register it on your own registry to serve it with your exporter::

            registry.register(watch.collector)
        """
        if self._collector is None:
            from normwatch.export.prometheus import NormwatchCollector

            collector = NormwatchCollector(self.layers, self.run_id, self.config.rank,
                                           self.config.limits, __version__)
            records = self.court.history.records()
            for i, record in enumerate(records):
                last = i == len(records) - 1
                collector.update(record.snapshot, self.alarms if last else [],
                                 self.verdicts if last else [], record.profile)
            if self.config.prometheus_aggregate:
                collector.across_ranks = self._across_ranks
            self._collector = collector
        return self._collector

    def push_metrics(self, gateway: str, job: str = "normwatch") -> None:
        """Push the current metrics to a Prometheus Pushgateway (e.g. at the end of a run),
        grouped by ``run_id`` and rank."""
        from normwatch.export.prometheus import MetricsEndpoint

        endpoint = self.endpoint or MetricsEndpoint(self.collector, self.run_id, self.config.rank)
        endpoint.push(gateway, job)

    @property
    def forward_order(self) -> list[str]:
        """Layer names in the order the forward pass first met them (then the unseen)."""
        return self._measure.forward_order

    @property
    def verdicts(self) -> list[Verdict]:
        """Every verdict so far (loss spikes, non-finite values, critical alarms)."""
        return self.court.verdicts

    @property
    def reports(self) -> list[Path]:
        """Folders of the post-mortem reports written so far."""
        return self._writer.reports

    def report_exception(self, exc: BaseException) -> Verdict | None:
        """Judge and report an exception that ended (or interrupted) training.

        The unflushed interval is read first (training is over: a synchronous read is
        fine), so the verdict sees every step up to the crash. ``KeyboardInterrupt`` and
        ``SystemExit`` are not faults: the interval is judged as at any flush (a verdict
        and report only if something in it was abnormal), else one log line and ``None``.
        Integrations call this from their exception hooks; the context-manager form of
        the watch calls it when the ``with`` block raises.
        """
        interrupt = isinstance(exc, KeyboardInterrupt | SystemExit)
        verdicts: tuple[Verdict, ...] = ()
        if self.unflushed:
            try:
                verdicts = self._flush(last=True, conclude=interrupt).new_verdicts
            except Exception as failure:  # the report must still be written
                warnings.warn(f"normwatch: reading the last interval failed "
                              f"({type(failure).__name__}: {failure}); judging on the flushes "
                              "before it", RuntimeWarning, stacklevel=2)
        if not interrupt:
            ruling = self.court.hear_exception(exc, self.step_count, self.forward_order)
            snapshot = self.last_snapshot or Snapshot(self.step_count, self._interval_start, {})
            self._sinks.exception(self.sinks, self._record(snapshot, ruling, last=True), exc)
            assert ruling.incident is not None
            return ruling.incident.verdict
        if not verdicts:
            logging.getLogger(self.config.logger).warning(
                "[interrupted] %s at step %d: nothing abnormal in the norms since the last "
                "report; no post-mortem", type(exc).__name__, self.step_count)
        return verdicts[-1] if verdicts else None

    def finish(self, exc: BaseException | None = None) -> Verdict | None:
        """End the run, the one way the loop, both callbacks and ``normwatch run`` end it:
        with ``exc`` (training raised) judge and report it (:meth:`report_exception`);
        without, judge the steps since the last flush (never raising for ``raise_on``:
        training is over). Then :meth:`close`. Returns the verdict reached, if any;
        harmless after close."""
        if self.closed:
            return None
        try:
            if exc is not None:
                return self.report_exception(exc)
            verdicts = self._flush(last=True).new_verdicts if self.unflushed else ()
            return verdicts[-1] if verdicts else None
        finally:
            self.close()

    def _closed_use(self, what: str) -> bool:
        """After :meth:`close`: warn once that ``what`` measures nothing; ``True`` then."""
        if not self.closed:
            return False
        if not self._warned_closed:
            self._warned_closed = True
            warnings.warn(f"normwatch: {what}() after close(): the hooks are removed, nothing "
                          "is measured", RuntimeWarning, stacklevel=3)
        return True

    def _devices(self) -> list[str]:
        """Where the watched model's parameters and buffers are now (for the reports)."""
        model = self._model()
        if model is None:
            return []
        found = {t.device: None for t in (*model.parameters(), *model.buffers())}
        return [device_name(d) for d in found]

    def checkpoint_ok(self) -> bool:
        """Whether a checkpoint written now would be a good one: no incident is open and
        every parameter of the model is finite (read now: one copy per device, at
        checkpoint time only). The trainer callbacks with ``guard=True`` refuse to write
        one otherwise; plain loops ask before they save."""
        if self.court.incidents.open is not None:
            return False
        model = self._model()
        if model is None:
            return True
        finite: dict[torch.device, list[torch.Tensor]] = {}
        for p in model.parameters():
            finite.setdefault(p.device, []).append(torch.isfinite(p.detach()).all())
        return all(bool(torch.stack(flags).all()) for flags in finite.values())

    def state_dict(self) -> dict[str, Any]:
        """Plain state for checkpoints: step count and the loss baseline."""
        return {"version": 1, "step_count": self.step_count,
                "postmortem": self.court.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (e.g. when resuming from a checkpoint)."""
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ConfigError(f"'state' must be a normwatch state dict (version 1): "
                              f"got {state!r:.80}")
        self.set_step(int(state["step_count"]))
        self.court.load_state_dict(state["postmortem"])

    def set_step(self, step: int) -> None:
        """Continue the step numbering from ``step`` completed steps (e.g. on resume)."""
        self.step_count = step
        self._measure.begin_step(step + 1, full=step % self.config.stats_every == 0)
        self._interval_start = step + 1

    def watch_optimizer(self, optimizer: object) -> None:
        """Measure each step of ``optimizer`` (a ``torch.optim.Optimizer`` or a wrapper of
        one): the global gradient norm it received and the update it made, on the device.
        Verdicts then tell an optimizer blow-up or a bad batch from a norm's fault."""
        if self._closed_use("watch_optimizer"):
            return
        self._updates.attach(optimizer)
        if self.guard is not None:
            self.guard.attach(optimizer)
        if self._clipping is None:
            self._clipping = clipping.install()

    def watch_scaler(self, scaler: object) -> None:
        """Read the scale of ``scaler`` (a ``torch.amp.GradScaler``) with each flush's copy
        and report gradient statistics divided by it; pass the unscaled loss to
        :meth:`step`, and ``skipped=True`` for the steps the scaler skips."""
        if self._closed_use("watch_scaler"):
            return
        self._scaler = scaler
        if self.guard is not None:
            self.guard.attach_scaler(scaler)

    def add_loss(self, loss: Any, step: int | None = None) -> None:
        """Record a loss for ``step`` (default: the last completed step) without stepping;
        for loops that learn the loss later than the step (e.g. from a logger)."""
        self._losses.record(loss, self.step_count if step is None else step)

    @property
    def alarms(self) -> list[Alarm]:
        """Every alarm emitted so far (after de-duplication), oldest first."""
        return self._dedup.history

    @property
    def disabled(self) -> dict[str, str]:
        """Layers whose hook failed and was removed, with the reason."""
        return self._measure.disabled

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Norm calls inside the block are not measured (an evaluation pass inside a
        training step, say). Compiled models do not recompile for it."""
        with self._measure.paused():
            yield

    def close(self) -> None:
        """Remove every hook; the model is left exactly as it was (code compiled while
        watched runs the hooks' switched-off tensor ops until it recompiles). Harmless
        twice."""
        if not self.closed and self.view is not None:
            self.view.note(exit_line(self._model_name, self.step_count, self.alarms,
                                     self.verdicts, self.reports, self.skipped_steps))
        self._measure.close()
        self._updates.detach()
        if self.guard is not None:
            self.guard.detach()
        if self._clipping is not None:
            self._clipping.remove()
        if not self.closed:
            self._sinks.close(self.sinks)
        if self.endpoint is not None:
            self.endpoint.close()
        self.closed = True

    def __enter__(self) -> Watch:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        fault = exc is not None and not isinstance(exc, NumericalHealthError | GeneratorExit)
        self.finish(exc if fault else None)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"step {self.step_count}"
        return f"<Watch {len(self.layers)} norm layers, {state}>"


def watch(model: nn.Module, optimizer: object = None, **options: Any) -> Watch:
    """Watch every normalization layer of ``model``; options as in :class:`WatchConfig`.
    With ``optimizer``, its steps too (:meth:`Watch.watch_optimizer`).

        >>> w = normwatch.watch(model, optimizer, flush_every=10, raise_on="critical")
    """
    w = Watch(model, WatchConfig.from_options(**options))
    if optimizer is not None:
        try:
            w.watch_optimizer(optimizer)
        except BaseException:
            w.close()
            raise
    return w
