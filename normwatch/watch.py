"""The :class:`Watch`: hooks on every norm layer, flushed into snapshots and alarms.

    >>> watch = normwatch.watch(model, flush_every=10)
    >>> for batch in data:
    ...     loss = model(batch).loss
    ...     loss.backward(); optimizer.step(); optimizer.zero_grad()
    ...     watch.step(loss)          # flushes every 10 steps, raises alarms
    >>> watch.close()                 # the model is exactly as before
"""

from __future__ import annotations

import numbers
import os
import time
import warnings
from collections import deque
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from normwatch.accumulator import Accumulator
from normwatch.alarms import Alarm, RuleContext, evaluate, is_fp16_run
from normwatch.blame import Verdict
from normwatch.config import WatchConfig
from normwatch.discovery import NormLayer, iter_norm_modules
from normwatch.dispatch import Dispatcher
from normwatch.distributed import aggregate
from normwatch.errors import ConfigError, NumericalHealthError
from normwatch.hooks import LayerHook, Runtime
from normwatch.postmortem import PostMortem
from normwatch.probe import FP16_MAX, ProbeResult, probe_fp16_safety
from normwatch.snapshot import FirstNonfinite, LayerStats, Snapshot, decode_score, optional
from normwatch.stats import Thresholds
from normwatch.triton_stats import available as triton_available

if TYPE_CHECKING:
    from normwatch.early import EarlyWarning
    from normwatch.exporter import Exporter

HISTORY_POINTS = 16


class Watch:
    """Monitor of a model's normalization layers. Build it with :func:`normwatch.watch`."""

    def __init__(self, model: nn.Module, config: WatchConfig | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigError(f"'model' must be a torch.nn.Module: got {type(model).__name__}")
        self.config = config or WatchConfig()
        pairs = list(iter_norm_modules(model, self.config.include, self.config.exclude))
        self.layers: tuple[NormLayer, ...] = tuple(layer for layer, _ in pairs)
        if not pairs:
            warnings.warn(
                f"normwatch: no normalization layers found in {type(model).__name__}"
                + (" matching include/exclude" if self.config.include or self.config.exclude
                   else "")
                + "; nothing will be measured (custom norms: normwatch.register_norm)",
                RuntimeWarning,
                stacklevel=3,
            )
        c = self.config
        if c.kernel == "triton" and not triton_available():
            raise ConfigError("'kernel' is 'triton' but Triton does not import here: install "
                              "triton, or use kernel='auto' or 'torch'")
        self._rt = Runtime(
            Accumulator(len(pairs), Thresholds(c.fp16_limit, c.eps_tol, c.common_mode_tol)),
            count_eval=c.count_eval,
            kernel=c.kernel,
        )
        self._hooks = [LayerHook(layer, module, i, self._rt) for i, (layer, module) in
                       enumerate(pairs)]
        self._by_name = {layer.name: layer for layer in self.layers}
        self._dispatcher = Dispatcher(c)
        self.postmortem = PostMortem(c, self.layers, self._dispatcher.history)
        self.run_id = c.run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self.exporter: Exporter | None = None
        self._early: EarlyWarning | None = None
        if c.prometheus_port is not None or c.prometheus_aggregate:
            self.exporter = self._start_exporter()
        self._history: dict[str, deque[tuple[int, float]]] = {
            layer.name: deque(maxlen=HISTORY_POINTS) for layer in self.layers
        }
        self._probes: dict[tuple[str, str], ProbeResult] = {}
        self._losses: list[tuple[int, torch.Tensor | float]] = []
        self._loss_warned = False
        self._commit_failed = False
        self.step_count = 0
        self._interval_start = 1
        self.flushes = 0
        self.last_snapshot: Snapshot | None = None
        self.last_findings: list[Alarm] = []
        """The rules' findings at the last flush, before de-duplication."""
        self.closed = False

    # -- the training-loop API ------------------------------------------------------------

    def step(self, loss: Any = None) -> Snapshot | None:
        """Mark the end of an optimizer step; flush every ``flush_every`` steps.

        ``loss`` (a scalar tensor or number) is kept on its device until the flush.
        Returns the snapshot when this step flushed, else ``None``.
        """
        self.step_count += 1
        self._record_loss(loss)
        if self.config.early_warning and (self._early is not None or
                                          self._rt.accumulator.on_cuda()):
            self._commit()  # the early-warning peek reads the folded state every step
        early = self._early_check()
        rt = self._rt
        rt.step = self.step_count + 1
        rt.calls_this_step = 0
        rt.check_outputs = False
        rt.full_stats = self.step_count % self.config.stats_every == 0
        for hook in self._hooks:
            hook.pending_recompute = 0
        if early or self.step_count % self.config.flush_every == 0:
            return self.flush()
        return None

    def _commit(self) -> None:
        """Fold the staged calls; a failure drops them with one warning, training goes on."""
        try:
            self._rt.accumulator.commit()
        except Exception as exc:  # never take the training run down
            if not self._commit_failed:
                self._commit_failed = True
                warnings.warn(f"normwatch: folding the step's statistics failed "
                              f"({type(exc).__name__}: {exc}); those measurements are dropped, "
                              "training continues", RuntimeWarning, stacklevel=3)

    def _early_check(self) -> bool:
        """Poll the last in-flight peek (no stall), launch the next; ``True``: flush now."""
        if not self.config.early_warning:
            return False
        blocks = {d: b for d, b in self._rt.accumulator.blocks.items()
                  if d.type == "cuda" or self._early is not None}
        if not blocks:
            return False
        if self._early is None:
            from normwatch.early import EarlyWarning

            self._early = EarlyWarning(self.config.fp16_limit)
        trouble = self._early.poll()
        self._early.launch(blocks)
        return bool(trouble)

    def flush(self) -> Snapshot:
        """Copy the interval's statistics to the host (the only sync), reset, run alarms."""
        if self._early is not None:
            self._early.reset()
        self._commit()
        rows, extras = self._rt.accumulator.read(self._loss_tensors())
        snapshot = self._snapshot(rows, extras)
        self._rt.accumulator.reset()
        for hook in self._hooks:
            hook.counts.reset()
        self._losses.clear()
        self._interval_start = self.step_count + 1
        self.flushes += 1
        check_every = self.config.output_check_every
        self._rt.check_outputs = check_every > 0 and self.flushes % check_every == 0
        self.last_snapshot = snapshot
        for name, stats in snapshot.layers.items():
            if stats.absmax is not None:
                self._history[name].append((snapshot.step, stats.absmax))
        context = RuleContext(self.config, self._by_name, self._run_probes(snapshot),
                              {k: tuple(v) for k, v in self._history.items()})
        self.last_findings = evaluate(snapshot, context)
        passed = self._dispatcher.deliver(self.last_findings)
        verdicts = len(self.postmortem.verdicts)
        self.postmortem.on_flush(snapshot, self.last_findings, passed, self.forward_order)
        if self.exporter is not None:
            shared = aggregate(snapshot) if self.config.prometheus_aggregate else snapshot
            self.exporter.update(shared, passed, self.postmortem.verdicts[verdicts:])
        self._dispatcher.raise_if_fatal(passed)
        return snapshot

    def push_metrics(self, gateway: str, job: str = "normwatch") -> None:
        """Push the current metrics to a Prometheus Pushgateway (e.g. at the end of a run),
        grouped by ``run_id`` and rank."""
        if self.exporter is None:  # no live exporter: replay the kept history into a new one
            self.exporter = self._start_exporter(serve=False)
            records = self.postmortem.history.records()
            for i, record in enumerate(records):
                last = i == len(records) - 1
                self.exporter.update(record.snapshot, self.alarms if last else [],
                                     self.verdicts if last else [])
        self.exporter.push(gateway, job)

    def _start_exporter(self, serve: bool = True) -> Exporter:
        from normwatch import __version__
        from normwatch.exporter import Exporter

        c = self.config
        exporter = Exporter(self.layers, self.run_id, c.rank, c.fp16_limit, __version__)
        if serve and c.prometheus_port is not None:
            exporter.serve(c.prometheus_port, c.prometheus_addr, c.prometheus_certfile,
                           c.prometheus_keyfile)
        return exporter

    @property
    def forward_order(self) -> list[str]:
        """Layer names in the order the forward pass first met them (then the unseen)."""
        seen = sorted(self._rt.forward_order, key=self._rt.forward_order.__getitem__)
        return seen + [layer.name for layer in self.layers if layer.name not in
                       self._rt.forward_order]

    @property
    def verdicts(self) -> list[Verdict]:
        """Every verdict so far (loss spikes, non-finite values, critical alarms)."""
        return self.postmortem.verdicts

    @property
    def reports(self) -> list[Path]:
        """Folders of the post-mortem reports written so far."""
        return self.postmortem.reports

    def report_exception(self, exc: BaseException) -> Verdict:
        """Judge and report an exception that ended (or interrupted) training.

        Integrations call this from their exception hooks; the context-manager form of
        the watch calls it when the ``with`` block raises.
        """
        return self.postmortem.on_exception(exc, self.step_count, self.forward_order)

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
        self._rt.step = step + 1
        self._interval_start = step + 1

    @property
    def alarms(self) -> list[Alarm]:
        """Every alarm emitted so far (after de-duplication), oldest first."""
        return self._dispatcher.history

    @property
    def disabled(self) -> dict[str, str]:
        """Layers whose hook failed and was removed, with the reason."""
        return {h.layer.name: h.disabled_reason for h in self._hooks
                if h.disabled_reason is not None}

    def close(self) -> None:
        """Remove every hook; the model is left exactly as it was. Harmless twice."""
        for hook in self._hooks:
            hook.remove()
        if self.exporter is not None:
            self.exporter.close()
        self.closed = True

    def __enter__(self) -> Watch:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if isinstance(exc, Exception) and not isinstance(exc, NumericalHealthError):
                self.report_exception(exc)
        finally:
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"step {self.step_count}"
        return f"<Watch {len(self.layers)} norm layers, {state}>"

    # -- internals ---------------------------------------------------------------------------

    def add_loss(self, loss: Any, step: int | None = None) -> None:
        """Record a loss for ``step`` (default: the last completed step) without stepping;
        for loops that learn the loss later than the step (e.g. from a logger)."""
        self._record_loss(loss, step)

    def _record_loss(self, loss: Any, step: int | None = None) -> None:
        step = self.step_count if step is None else step
        if loss is None:
            return
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append((step, loss.detach().reshape(())))
        elif isinstance(loss, numbers.Real):
            self._losses.append((step, float(loss)))
        elif not self._loss_warned:
            self._loss_warned = True
            got = (f"tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                   else type(loss).__name__)
            warnings.warn(f"normwatch: 'loss' must be a scalar tensor or a number: got {got}; "
                          "losses are not recorded", RuntimeWarning, stacklevel=3)

    def _loss_tensors(self) -> dict[torch.device, torch.Tensor]:
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for _, value in self._losses:
            if isinstance(value, torch.Tensor):
                by_device.setdefault(value.device, []).append(value.to(torch.float64))
        return {d: torch.stack(v) for d, v in by_device.items()}

    def _snapshot(
        self, rows: list[dict[str, float]], extras: dict[torch.device, list[float]]
    ) -> Snapshot:
        layers: dict[str, LayerStats] = {}
        first: tuple[float, str, str] | None = None
        for hook, row in zip(self._hooks, rows, strict=True):
            layers[hook.layer.name] = _layer_stats(hook, row)
            for origin, col in (("input", "first_arrived_score"), ("norm", "first_born_score")):
                score = row[col]
                if score > 0 and (first is None or score > first[0]):
                    first = (score, hook.layer.name, origin)
        first_nonfinite = None
        decoded = decode_score(first[0]) if first is not None else None
        if first is not None and decoded is not None:
            first_nonfinite = FirstNonfinite(
                decoded[0], first[1], self._rt.forward_order.get(first[1], -1),
                "input" if first[2] == "input" else "norm",
            )
        iters = {d: iter(v) for d, v in extras.items()}
        losses = []
        for step, value in self._losses:
            if isinstance(value, torch.Tensor):
                value = next(iters[value.device])
            losses.append((step, value))
        return Snapshot(self.step_count, self._interval_start, layers, first_nonfinite,
                        tuple(losses))

    def _run_probes(self, snapshot: Snapshot) -> dict[str, ProbeResult]:
        results: dict[str, ProbeResult] = {}
        limit = self.config.fp16_limit
        for hook in self._hooks:
            stats = snapshot.layers[hook.layer.name]
            if not stats.seen or not is_fp16_run(stats):
                continue
            big = (stats.absmax or 0.0) > limit or (stats.sumsq_max or 0.0) > FP16_MAX
            shape, device = hook.counts.input_shape, hook.counts.device
            if not big or shape is None or device is None:
                continue
            key = (hook.layer.name, "float16")
            if key not in self._probes:
                self._rt.paused = True
                try:
                    self._probes[key] = probe_fp16_safety(hook.layer, hook.module, shape,
                                                          torch.float16, device)
                finally:
                    self._rt.paused = False
            results[hook.layer.name] = self._probes[key]
        return results


def _layer_stats(hook: LayerHook, row: dict[str, float]) -> LayerStats:
    c = hook.counts
    finite = int(row["finite_tokens"])
    full = int(row["stats_tokens"])
    return LayerStats(
        name=hook.layer.name,
        kind=hook.layer.kind,
        calls=c.calls,
        tokens=c.tokens,
        finite_tokens=finite,
        stats_tokens=full,
        absmax=optional(row["absmax"]),
        fp16_overflow_tokens=int(row["fp16_overflow_tokens"]),
        sumsq_max=optional(row["sumsq_max"]),
        rms_min=optional(row["rms_min"]),
        rms_mean=row["rms_sum"] / full if full else None,
        rms_max=optional(row["rms_max"]),
        eps_dominance=optional(row["eps_dominance"]),
        eps_dominated_tokens=int(row["eps_dominated_tokens"]),
        common_mode_max=optional(row["common_mode_max"]),
        common_mode_tokens=int(row["common_mode_tokens"]),
        nonfinite=int(row["nonfinite"]),
        out_nonfinite=int(row["out_nonfinite"]),
        out_absmax=optional(row["out_absmax"]),
        output_mismatch=optional(row["output_mismatch"]),
        input_dtype=c.input_dtype,
        weight_dtype=c.weight_dtype,
        output_dtype=c.output_dtype,
        autocast=c.autocast,
    )


def watch(model: nn.Module, **options: Any) -> Watch:
    """Watch every normalization layer of ``model``; options as in :class:`WatchConfig`.

        >>> w = normwatch.watch(model, flush_every=10, raise_on="critical")
    """
    return Watch(model, WatchConfig.from_options(**options))
