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
from collections import deque
from collections.abc import Iterator
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
from normwatch.judge.depth import worst_fp16_gradient
from normwatch.measure.compiling import compiled_code, guard_hooks
from normwatch.measure.discovery import iter_norm_modules
from normwatch.measure.gradients import unscale
from normwatch.measure.losses import LossBuffer, ride_along
from normwatch.measure.measurement import Measurement
from normwatch.measure.triton_kernel import available as triton_available
from normwatch.measure.triton_kernel import usable as triton_usable
from normwatch.measure.updates import UpdateMonitor
from normwatch.records import Alarm, NormLayer, Snapshot, Verdict
from normwatch.report.dispatch import Dispatcher
from normwatch.report.document import prepare_report_dir
from normwatch.report.lines import attach_line, exit_line, verdict_line
from normwatch.report.postmortem import PostMortem

if TYPE_CHECKING:
    from normwatch.export.prometheus import MetricsEndpoint, NormwatchCollector
    from normwatch.measure.early import EarlyWarning
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
        stale = compiled_code(model) if pairs and drop_compiled else []
        if stale:
            warnings.warn(
                f"normwatch: {type(model).__name__} was compiled before watch() (compiled "
                f"code for {', '.join(stale)}), and compiled code never runs hooks added "
                "later; resetting torch.compile's caches (torch.compiler.reset()) so the next "
                "call recompiles with them. Attach before the first compiled call to avoid "
                "the recompile", RuntimeWarning, stacklevel=3)
            torch.compiler.reset()
        if not pairs:
            warnings.warn(
                f"normwatch: no normalization layers found in {type(model).__name__}"
                + (" matching include/exclude" if c.include or c.exclude else "")
                + "; nothing will be measured (custom norms: normwatch.register_norm)",
                RuntimeWarning,
                stacklevel=3,
            )
        self._measure = Measurement(pairs, c.limits, count_eval=c.count_eval, kernel=c.kernel,
                                    root=model, output_checks=c.output_check_every > 0,
                                    gradients=c.gradients)
        self.layers: tuple[NormLayer, ...] = self._measure.layers
        self._by_name = {layer.name: layer for layer in self.layers}
        self._dispatcher = Dispatcher(c)
        self.postmortem = PostMortem(c, self.layers, self._dispatcher.history)
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
        self._absmax_history: dict[str, deque[tuple[int, float]]] = {
            layer.name: deque(maxlen=HISTORY_POINTS) for layer in self.layers
        }
        self._grad_history: deque[tuple[int, float]] = deque(maxlen=HISTORY_POINTS)
        self._losses = LossBuffer()
        self._updates = UpdateMonitor(lambda: self.step_count + 1)
        self.step_count = 0
        self._interval_start = 1
        self.flushes = 0
        self.last_snapshot: Snapshot | None = None
        self.last_findings: list[Alarm] = []
        """The rules' findings at the last flush, before de-duplication."""
        self._last_check: list[Alarm] = []
        self.closed = False
        self._warned_closed = False
        self.view: ConsoleView | None = None
        """Where the console output goes (``console`` option; assign your own)."""
        self._scaler: object = None
        self.skipped_steps = 0
        """Steps whose optimizer step a loss scaler skipped (``step(skipped=True)``)."""
        self._model_name = type(model).__name__
        self._idle_checked = False
        _LIVE.add(self)
        if c.console is not None:
            from normwatch.report.live import ConsoleView

            self.view = ConsoleView(live=None if c.console == "live" else False)
            self.view.note(attach_line(self._model_name, self.layers, c.flush_every,
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
            self._measure.commit()  # the early-warning peek reads the folded state every step
        early = self._early_check()
        self._measure.begin_step(self.step_count + 1,
                                 full=self.step_count % self.config.stats_every == 0)
        if early or self.step_count % self.config.flush_every == 0:
            return self.flush()
        return None

    def _early_check(self) -> bool:
        """Poll the last in-flight peek (no stall), launch the next; ``True``: flush now."""
        if not self.config.early_warning:
            return False
        blocks = {d: b for d, b in self._measure.blocks.items()
                  if d.type == "cuda" or self._early is not None}
        if not blocks:
            return False
        if self._early is None:
            from normwatch.measure.early import EarlyWarning

            self._early = EarlyWarning(self.config.fp16_limit)
        trouble = self._early.poll()
        self._early.launch(blocks)
        return bool(trouble)

    def flush(self) -> Snapshot:
        """Copy the interval's statistics to the host (the only sync), reset, run alarms."""
        if self._closed_use("flush"):
            return Snapshot(self.step_count, self._interval_start, {})
        return self._flush()[0]

    @property
    def unflushed(self) -> bool:
        """Whether steps or norm calls were measured since the last flush."""
        return self.step_count >= self._interval_start or self._measure.pending

    def _flush(self, conclude: bool = True, fatal: bool = True
               ) -> tuple[Snapshot, list[Verdict]]:
        """:meth:`flush`; ``conclude``: judge triggers (else only record the interval);
        ``fatal``: raise per ``raise_on``. Returns the snapshot and its new verdicts."""
        if self._early is not None:
            self._early.reset()
        checked = self._measure.checking_outputs
        scale = getattr(self._scaler, "_scale", None)
        scale = scale if isinstance(scale, torch.Tensor) else None
        scales = {} if scale is None else {scale.device: scale}
        rows, copied = self._measure.read(ride_along(self._losses.tensors(),
                                                     self._updates.tensors(), scales))
        values = {d: iter(v) for d, v in copied.items()}  # losses, updates, then the scale
        losses, updates = self._losses.resolve(values), self._updates.resolve(values)
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
        self.last_snapshot = snapshot
        for name, stats in snapshot.layers.items():
            if stats.absmax is not None:
                self._absmax_history[name].append((snapshot.step, stats.absmax))
        worst = worst_fp16_gradient(snapshot)
        if worst is not None and worst.grad_out_absmax is not None:
            self._grad_history.append((snapshot.step, worst.grad_out_absmax))
        context = RuleContext(self.config, self._by_name, self._measure.probes(snapshot),
                              {k: tuple(v) for k, v in self._absmax_history.items()},
                              self.forward_order, tuple(self._grad_history))
        self.last_findings = evaluate(snapshot, context)
        if checked:
            self._last_check = [a for a in self.last_findings if a.kind == "output_mismatch"]
        passed = self._dispatcher.deliver(self.last_findings, self.forward_order)
        if self.view is not None:
            for line in self._dispatcher.last_lines:
                self.view.alarm(line)
            self.view.update(snapshot, self.health_findings, self.config.fp16_limit,
                             {k: tuple(a for _, a in v) for k, v in self._absmax_history.items()})
        verdicts = self.postmortem.on_flush(snapshot, self.last_findings, passed,
                                            self.forward_order, conclude=conclude)
        self._show(verdicts)
        if fatal and not self._idle_checked:  # a regular flush (not a crash's last read)
            self._idle_checked = True
            self._warn_if_idle(snapshot)
        if self._collector is not None:
            shared = snapshot
            # only at the regular flushes every rank reaches (an early flush is one rank's)
            if self.config.prometheus_aggregate and \
                    self.step_count % self.config.flush_every == 0:
                from normwatch.export.crossrank import combine_ranks

                shared = self._measure.snapshot(combine_ranks(rows), snapshot.step,
                                                snapshot.first_step, losses, updates)
            self._collector.update(shared, passed, verdicts, self.forward_order,
                                   self.config.placement)
        if fatal:
            self._dispatcher.raise_if_fatal(passed)
        return snapshot, verdicts

    def _show(self, verdicts: list[Verdict]) -> None:
        if self.view is not None:
            for verdict in verdicts:
                self.view.note(verdict_line(verdict), style="bold red")

    def _warn_if_idle(self, snapshot: Snapshot) -> None:
        """After the first flush: one warning if no norm call was measured, saying why."""
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
    def health_findings(self) -> list[Alarm]:
        """The last flush's findings and, when that flush did not check outputs (every
        ``output_check_every`` flushes), the last output check's: what a layer's health
        rests on."""
        current = {(a.kind, a.layer) for a in self.last_findings}
        return self.last_findings + [a for a in self._last_check
                                     if (a.kind, a.layer) not in current]

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
            records = self.postmortem.history.records()
            for i, record in enumerate(records):
                last = i == len(records) - 1
                collector.update(record.snapshot, self.alarms if last else [],
                                 self.verdicts if last else [], self.forward_order,
                                 self.config.placement)
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
        return self.postmortem.verdicts

    @property
    def reports(self) -> list[Path]:
        """Folders of the post-mortem reports written so far."""
        return self.postmortem.reports

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
        verdicts: list[Verdict] = []
        if self.unflushed:
            try:
                verdicts = self._flush(conclude=interrupt, fatal=False)[1]
            except Exception as failure:  # the report must still be written
                warnings.warn(f"normwatch: reading the last interval failed "
                              f"({type(failure).__name__}: {failure}); judging on the flushes "
                              "before it", RuntimeWarning, stacklevel=2)
        if not interrupt:
            verdict = self.postmortem.on_exception(exc, self.step_count, self.forward_order)
            self._show([verdict])
            return verdict
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
            verdicts = self._flush(fatal=False)[1] if self.unflushed else []
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

    def state_dict(self) -> dict[str, Any]:
        """Plain state for checkpoints: step count and the loss baseline."""
        return {"version": 1, "step_count": self.step_count,
                "postmortem": self.postmortem.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (e.g. when resuming from a checkpoint)."""
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ConfigError(f"'state' must be a normwatch state dict (version 1): "
                              f"got {state!r:.80}")
        self.set_step(int(state["step_count"]))
        self.postmortem.load_state_dict(state["postmortem"])

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

    def watch_scaler(self, scaler: object) -> None:
        """Read the scale of ``scaler`` (a ``torch.amp.GradScaler``) with each flush's copy
        and report gradient statistics divided by it; pass the unscaled loss to
        :meth:`step`, and ``skipped=True`` for the steps the scaler skips."""
        if self._closed_use("watch_scaler"):
            return
        self._scaler = scaler

    def add_loss(self, loss: Any, step: int | None = None) -> None:
        """Record a loss for ``step`` (default: the last completed step) without stepping;
        for loops that learn the loss later than the step (e.g. from a logger)."""
        self._losses.record(loss, self.step_count if step is None else step)

    @property
    def alarms(self) -> list[Alarm]:
        """Every alarm emitted so far (after de-duplication), oldest first."""
        return self._dispatcher.history

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
        if self.view is not None:
            self.view.close()
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
