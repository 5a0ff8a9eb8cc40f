"""The measurement of one model: its norm hooks, their step flags and the accumulator.

    >>> m = Measurement(iter_norm_modules(model), Limits())
    >>> m.begin_step(step=2, full=True)       # after each optimizer step
    >>> rows, copied = m.read(losses)         # the flush: one device-to-host copy
    >>> snapshot = m.snapshot(rows, ...)      # plain data
    >>> m.reset(check_outputs=False)

:meth:`read` returns each layer's *raw* row (every combinable column of
:mod:`normwatch.catalog`, host counts included), so rows from several ranks can be
combined before :meth:`snapshot` derives the user-facing statistics.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from normwatch.catalog import PUBLIC, decode_score, values
from normwatch.guarded import Part
from normwatch.measure.backends import choose
from normwatch.measure.layer.compiling import eager_frame
from normwatch.measure.layer.hooks import LayerHook, module_device
from normwatch.measure.layer.recorder import HostCounts, Runtime
from normwatch.measure.layer.unwatched import PicklesUnwatched
from normwatch.measure.model.probe import ProbeCache, ProbeTarget
from normwatch.measure.model.sharding import unsharded_params
from normwatch.measure.state.accumulator import Accumulator
from normwatch.measure.step.replay import ReplayLog
from normwatch.records import (
    FirstNonfinite,
    LayerStats,
    Limits,
    NormLayer,
    ProbeResult,
    Snapshot,
    UpdateStats,
)


class Measurement(PicklesUnwatched):
    """Hooks on ``pairs`` (``(NormLayer, module)``, e.g. from
    :func:`~normwatch.measure.model.discovery.iter_norm_modules`); see the module docstring."""

    def __init__(self, pairs: Iterable[tuple[NormLayer, nn.Module]], limits: Limits,
                 *, count_eval: bool = False, kernel: str = "auto",
                 root: nn.Module | None = None, output_checks: bool = True,
                 gradients: bool = True, poison: bool = False) -> None:
        """``poison``: :meth:`poisoned` will be asked each step (the guard)."""
        pairs = list(pairs)
        self.layers: tuple[NormLayer, ...] = tuple(layer for layer, _ in pairs)
        self.limits = limits
        backend = partial(choose, kernel=kernel)
        self._rt = Runtime(Accumulator(len(pairs), backend, limits), count_eval=count_eval,
                           output_checks=output_checks, gradients=gradients)
        self._rt.accumulator.watch_poison = poison
        self.replay = ReplayLog()
        """Each step's batch fingerprint and RNG states (:mod:`~normwatch.measure.step.replay`)."""
        self.replay.begin_step(1)
        fallback = None if root is None else module_device(root)
        self._hooks = [LayerHook(layer, module, i, self._rt, module_device(module) or fallback)
                       for i, (layer, module) in enumerate(pairs)]
        self._counts = [hook.counts for hook in self._hooks]
        """Each hook's host counts (kept by the hook for good: reset in place)."""
        self._probes = ProbeCache(self.paused)
        self._measured: bool | None = None
        """Whether the weights' hooks are armed for a measured backward (``None``: not yet
        set by :meth:`begin_step`)."""
        self._unplaced = any(hook.recorder.state is None for hook in self._hooks)
        """Whether a hook waits for its module to leave the meta device."""
        self._folding = Part("folding the step's statistics", "those measurements are dropped")
        # A forward of ``root`` that raised leaves its calls behind: marked where it began,
        # dropped at the next step unless it completed.
        self._open: _OpenForward | None = None
        # FSDP2's unsharded weights, for the weight hooks compiled blocks cannot move
        # (:meth:`_follow_unsharded`): looked up until found, again at each reset (never
        # again where nothing is sharded)
        self._root = root
        self._can_find_unsharded = gradients and root is not None
        self._find_unsharded = self._can_find_unsharded
        self._unsharded = Part("finding FSDP2's unsharded weights",
                               "weight gradients of compiled sharded blocks are not measured",
                               off=self._stop_finding)
        self._root_handles = [] if root is None else [
            root.register_forward_pre_hook(self._forward_begins, with_kwargs=True),
            root.register_forward_hook(self._forward_ends)]

    @property
    def accumulator(self) -> Accumulator:
        return self._rt.accumulator

    def begin_step(self, step: int, full: bool) -> None:
        """Start step ``step`` (1-based); ``full``: measure every statistic, else the
        sentinel tier only."""
        rt = self._rt
        self.discard_interrupted()
        if rt.accumulator.has_staged_grads:
            self.commit(rt.accumulator.commit_grads, step_over=True)  # its backward is done
        rt.accumulator.begin_step()
        self.replay.begin_step(step)
        rt.update(step=step, calls_this_step=0, full_stats=full)
        if self._find_unsharded:
            self._follow_unsharded()
        measured = rt.gradients and full
        if measured is self._measured and not rt.recomputing and not self._unplaced:
            return  # (inside a training run every line costs: the hooks are as they were)
        unplaced, self._measured, self._unplaced = self._unplaced, measured, False
        for grads in tuple(rt.toggled):  # (Python weight hooks alone: C++ ones stay)
            grads.arm(measured)
        if rt.recomputing:
            rt.recomputing = False
            for hook in self._hooks:
                hook.recorder.pending_recompute = 0
        if unplaced:
            self._place()

    def _place(self) -> None:
        """Place the hooks built on the meta device whose module was placed since."""
        for hook in self._hooks:
            if hook.recorder.state is None:
                device = module_device(hook.module)
                if device is not None and device.type != "meta":
                    hook.home(device)  # compiled code traced without it recompiles once
                else:
                    self._unplaced = True

    def _follow_unsharded(self) -> None:
        """Hook the weights FSDP2 unshards into the norms (eager hooks follow them inside
        each forward; compiled ones cannot). Looks until the first forward made them;
        stops at once where nothing is sharded or the lookup fails (one warning)."""
        assert self._root is not None
        try:
            found = unsharded_params(self._root)
            if found is None:  # nothing sharded: no need to look again
                self._can_find_unsharded = False
            if found is None or found:
                self._find_unsharded = False
            for hook in self._hooks:
                weight = (found or {}).get((id(hook.module), "weight"))
                if weight is not None and hook.grads is not None:
                    hook.grads.watch_weight(weight)
        except Exception as exc:  # never take the training run down
            self._unsharded.fail(exc)

    def _stop_finding(self) -> None:
        self._find_unsharded = self._can_find_unsharded = False

    @eager_frame
    def _forward_begins(self, module: nn.Module, args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> None:
        if torch.compiler.is_compiling():  # traced: no Python state (nothing to drop)
            return
        if self._open is None:  # the outermost call
            if module.training:  # a training step's: what replays it
                self.replay.forward(args, kwargs)
            self._open = _OpenForward(self._rt.accumulator.mark(), self._rt.calls_this_step,
                                      list(map(_calls_tokens, self._counts)))

    @eager_frame
    def _forward_ends(self, module: nn.Module, args: object, output: object) -> None:
        if not torch.compiler.is_compiling():
            self._open = None
            if self._find_unsharded:  # before the first backward
                self._follow_unsharded()

    def discard_interrupted(self) -> None:
        """Forget the calls of a forward of the root that raised and never completed (the
        loop went on to its next step); before anything folds them."""
        open_, self._open = self._open, None
        if open_ is not None and self._rt.accumulator.drop_since(open_.staged):
            self._rt.calls_this_step = open_.calls_this_step
            for hook, (calls, tokens) in zip(self._hooks, open_.counts, strict=True):
                hook.counts.calls, hook.counts.tokens = calls, tokens

    def commit(self, fold: Callable[[bool], None] | None = None, step_over: bool = False
               ) -> None:
        """Fold the staged calls (or run ``fold``: one of the accumulator's commits); a
        failure drops them with one warning, training goes on. ``step_over``: the step
        has ended (the guard's poison check of its rows is over: not noted)."""
        try:
            (fold or self._rt.accumulator.commit)(step_over)
        except Exception as exc:  # never take the training run down
            self._folding.fail(exc)  # warns once; later folds are still tried

    @property
    def full_stats(self) -> bool:
        """Whether the step under way measures every statistic (else the sentinel tier)."""
        return self._rt.full_stats

    def poisoned(self) -> list[torch.Tensor]:
        """Whether the step under way held NaN/inf in a norm's input, output or gradient
        (0-d bool tensors, per device and fold; no sync)."""
        return self._rt.accumulator.poisoned()

    def step_rows(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What :meth:`poisoned` reads: the flags of the step's folds so far, and the
        rows it staged since (for a backend's own check: ``backend.check``)."""
        return self._rt.accumulator.step_rows()

    def drop_step_gradients(self) -> None:
        """Forget the gradients this step's backward staged (a loss scaler skipped the
        step: they are scaled past fp16, and not the model's)."""
        self._rt.accumulator.drop_grads()

    @property
    def modules(self) -> list[nn.Module]:
        """The hooked norm modules."""
        return [h.module for h in self._hooks]

    def uncounted(self) -> tuple[int, int]:
        """Norm calls not measured since the watch began: in eval mode, without grad."""
        return (sum(h.counts.eval_calls for h in self._hooks),
                sum(h.counts.no_grad_calls for h in self._hooks))

    @property
    def pending(self) -> bool:
        """Whether any layer was called since the last :meth:`reset`."""
        return any(h.counts.calls for h in self._hooks)

    @property
    def blocks(self) -> dict[torch.device, torch.Tensor]:
        """The accumulator's live device blocks (for the early-warning peek; read-only)."""
        return self._rt.accumulator.blocks

    def on_cuda(self) -> bool:
        """Whether anything measured so far lives on a CUDA device."""
        return self._rt.accumulator.on_cuda()

    def read(self, extras: Mapping[torch.device, torch.Tensor | Sequence[torch.Tensor]]
             | None = None
             ) -> tuple[list[dict[str, float]], dict[torch.device, list[float]]]:
        """Every layer's raw row (device columns and host counts) and ``extras``, in one
        device-to-host copy per device. Does not reset."""
        self.commit()
        rows, copied = self._rt.accumulator.read(dict(extras or {}))
        for row, hook in zip(rows, self._hooks, strict=True):
            row["calls"] += hook.counts.empty_calls
        return rows, copied

    @property
    def checking_outputs(self) -> bool:
        """Whether this interval compares outputs with the formula."""
        return self._rt.check_outputs and self._rt.output_checks

    def reset(self, check_outputs: bool) -> None:
        """Start a new interval; ``check_outputs``: compare outputs with the formula in it."""
        self._rt.accumulator.reset()
        self._find_unsharded = self._can_find_unsharded
        for hook in self._hooks:
            hook.counts.reset()
        self._rt.update(check_outputs=check_outputs)

    def snapshot(self, rows: Sequence[Mapping[str, float]], step: int, first_step: int,
                 losses: tuple[tuple[int, float], ...] = (),
                 updates: tuple[UpdateStats, ...] = ()) -> Snapshot:
        """The plain-data snapshot of raw ``rows`` (one per layer, as :meth:`read` gives)."""
        order = self._rt.forward_order
        return build_snapshot(self.layers, rows, [h.counts for h in self._hooks], order,
                              self.limits, step, first_step, losses, updates)

    def probes(self, snapshot: Snapshot) -> dict[str, ProbeResult]:
        """fp16-safety probes of the layers whose statistics call for one (cached)."""
        targets: Iterator[tuple[NormLayer, nn.Module, ProbeTarget]] = (
            (h.layer, h.module, (h.counts.input_shape, h.counts.device)) for h in self._hooks)
        return self._probes.results(snapshot, self.limits.fp16_limit, targets)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hooks stand aside (e.g. while a probe runs a copy of a layer)."""
        self._rt.update(paused=True)
        try:
            yield
        finally:
            self._rt.update(paused=False)

    @property
    def forward_order(self) -> list[str]:
        """Layer names in the order the forward pass first met them (then the unseen)."""
        seen = self._rt.forward_order
        return sorted(seen, key=seen.__getitem__) + [
            layer.name for layer in self.layers if layer.name not in seen]

    @property
    def disabled(self) -> dict[str, str]:
        """Layers whose hook failed and was removed, with the reason."""
        return {h.layer.name: h.disabled_reason for h in self._hooks
                if h.disabled_reason is not None}

    def close(self) -> None:
        """Remove every hook (harmless twice). Code compiled while watched keeps the
        hooks' tensor ops until it recompiles: they are switched off here."""
        self._rt.update(paused=True)
        for hook in self._hooks:
            hook.remove()
        for handle in self._root_handles:
            handle.remove()


_calls_tokens = operator.attrgetter("calls", "tokens")


@dataclass(frozen=True)
class _OpenForward:
    """Where a forward of the root began: staging, the step's call index, host counts."""

    staged: tuple[int, int]
    calls_this_step: int
    counts: list[tuple[int, int]]


def build_snapshot(layers: Sequence[NormLayer], rows: Sequence[Mapping[str, float]],
                   counts: Sequence[HostCounts], order: Mapping[str, int], limits: Limits,
                   step: int, first_step: int, losses: tuple[tuple[int, float], ...] = (),
                   updates: tuple[UpdateStats, ...] = ()) -> Snapshot:
    """Derive each layer's :class:`LayerStats` from its raw row (pure) and locate the
    interval's first non-finite value."""
    stats: dict[str, LayerStats] = {}
    first: tuple[float, str, str] | None = None
    for layer, row, c in zip(layers, rows, counts, strict=True):
        public = {k: v for k, v in values(row, limits).items() if k in PUBLIC}
        stats[layer.name] = LayerStats(
            name=layer.name, kind=layer.kind, **public,  # type: ignore[arg-type]
            input_dtype=c.input_dtype, weight_dtype=c.weight_dtype,
            output_dtype=c.output_dtype, autocast=c.autocast, autocast_made=c.autocast_made)
        for origin, column in (("input", "first_arrived_score"), ("norm", "first_born_score")):
            score = row[column]
            if score > 0 and (first is None or score > first[0]):
                first = (score, layer.name, origin)
    decoded = decode_score(first[0]) if first is not None else None
    first_nonfinite = None
    if first is not None and decoded is not None:
        first_nonfinite = FirstNonfinite(decoded[0], first[1], order.get(first[1], -1),
                                         "input" if first[2] == "input" else "norm")
    return Snapshot(step, first_step, stats, first_nonfinite, losses, updates)
