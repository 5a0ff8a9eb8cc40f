"""The seam between what is recorded and how it is computed: one protocol, one
implementation per device (:mod:`normwatch.measure.backends` chooses, in one place).

    >>> backend = choose(x.device, kernel="auto")        # normwatch.measure.backends
    >>> call = backend.call_rows(layer, x, y, key, full)  # one norm call's rows
    >>> norms, lo, hi = backend.grad_rows(layer, site, g, None)
    >>> lines = backend.fold(calls, plan)                 # the step's calls, one line each
    >>> backend.accumulate(lines, plan.rows, block)       # into the per-layer state
    >>> out = backend.check(rows, grads)                  # the guard's, or None

Every backend reads the same things into the same layouts (:mod:`~normwatch.measure.state.
rows`), and may decline nothing: where its fast way does not cover a tensor (a dtype, a
layout, a device), it computes the statistic by torch's ops, the universal fallback.
The recorder, the gradient hooks, the accumulator and the update monitor call only this
protocol; what a backend adds of its own (the native backend's C++ lanes) plugs in
behind it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from normwatch.measure.state.rows import CallRows, GradRows, LayerRows

if TYPE_CHECKING:
    from normwatch.measure.state.fold import FoldPlan
    from normwatch.measure.state.grad_fold import GradPlan


class Sample(Protocol):
    """The update monitor's sample of one device and dtype, as a backend measures it
    (torch's: :class:`~normwatch.measure.optimizer.updates.Pack`)."""

    keep: bool
    """Whether its buffers are kept between steps."""
    device: torch.device

    def store(self, values: list[torch.Tensor], unchanged: bool) -> None:
        """Keep the samples' ``values`` before the step (``unchanged``: nothing wrote the
        parameters since the last step's read)."""

    def measure(self, after: list[torch.Tensor], grads: list[torch.Tensor] | None,
                size: bool) -> torch.Tensor:
        """``[|g|², |Δp|², |p|²]`` (float64, on the device): the change since
        :meth:`store` to the samples' values ``after`` the step, ``|p|²`` with ``size``,
        ``|g|²`` from ``grads`` (laid out like the parameters; ``None``: 0)."""


class Launcher(Protocol):
    """A backend's kernel as a C++ lane launches it to read a call (a *launch lane*:
    :mod:`~normwatch.measure.backends.native.lane`)."""

    def lane_plan(self, x: torch.Tensor, y: torch.Tensor, full: bool, centred: bool
                  ) -> tuple[tuple[int, int], object, torch.device, Any] | None:
        """A call's layout planned: ``(rows' shape, the lender's key, device, static
        launch)`` (the last: a :data:`~normwatch.measure.backends.triton_launch.Spec` the
        lane launches from C++, or ``None``: by :meth:`lane_launch`), or ``None``: not
        covered (asked once per layout and tier)."""

    def lane_launch(self, x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor, n: int,
                    width: int, full: bool, centred: bool) -> None:
        """A call of ``n`` tokens of ``width`` read into ``rows`` (one launch)."""

    def lane_grad_plan(self, g: torch.Tensor
                       ) -> tuple[tuple[int, int], object, torch.device, Any] | None:
        """A gradient's layout planned as :meth:`lane_plan` plans a call's (a site's, not
        the weight's: its whole norm is torch's), its static launches a pair: without
        and with a second part."""

    def lane_grad_launch(self, g: torch.Tensor, part: torch.Tensor | None,
                         rows: torch.Tensor, n: int, width: int) -> None:
        """A gradient of ``n`` tokens of ``width`` (plus ``part``, laid out alike) read
        into ``rows`` as :meth:`Backend.grad_rows` reads it (one launch)."""

    def lane_through_plan(self, layer: LayerRows, g: torch.Tensor, x: torch.Tensor,
                          weight: torch.Tensor | None
                          ) -> tuple[tuple[int, int], object, torch.device, Any] | None:
        """A compiled output gradient's layout planned with the gradient through the norm
        (from ``x`` and ``weight``), as :meth:`lane_plan` plans a call's: two buffers of
        the shape, one static launch (``None``: :meth:`Backend.through_rows` reads it)."""


class Backend(Protocol):
    """How one device's statistics are computed. ``name``: ``"torch"``, ``"triton"`` or
    ``"native"``."""

    name: str

    def launcher(self) -> Launcher | None:
        """What a C++ lane launches to read this backend's calls, or ``None``: the
        recorder reads them (with :meth:`call_rows`; on the CPU the native backend's lane
        reads them itself)."""

    def call_rows(self, layer: LayerRows, x: torch.Tensor, out: torch.Tensor | None,
                  key: float | torch.Tensor, full: bool) -> CallRows:
        """One call's rows: input ``x`` (not empty), output ``out`` (a non-empty floating
        tensor, or ``None``), the call's ``key``; ``full``: with the moments."""

    def grad_rows(self, layer: LayerRows, site: int, g: torch.Tensor,
                  part: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One gradient's rows at ``site`` (``g`` as tokens, detached; ``part``: a second
        part of it, laid out alike, added): ``(norms, lo, hi)`` as
        :class:`~normwatch.measure.state.rows.GradRows` holds them; the weight's
        (``WEIGHT``): its whole gradient's norm, first."""

    def covers_through(self, layer: LayerRows, x: torch.Tensor, weight: object) -> bool:
        """Whether :meth:`through_rows` computes the gradient through the norm for its
        input ``x`` and ``weight`` (asked in the forward)."""

    def through_rows(self, layer: LayerRows, g: torch.Tensor, x: torch.Tensor,
                     weight: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The output's gradient ``g`` and the gradient through the norm (from ``g``,
        ``x`` and ``weight``) read in one pass, packed rows each; ``None``: not here
        (the caller reads ``g`` and computes the other by torch's ops)."""

    def fold(self, calls: Sequence[CallRows], plan: FoldPlan) -> torch.Tensor:
        """The staged calls' lines (:func:`~normwatch.measure.state.fold.fold_calls`)."""

    def accumulate(self, lines: torch.Tensor, rows: torch.Tensor, block: torch.Tensor
                   ) -> None:
        """Fold ``lines`` into ``block`` at ``rows``: sums added, maxima and minima kept
        (a NaN never beats a value)."""

    def fold_grads(self, block: torch.Tensor, staged: Sequence[GradRows], plan: GradPlan
                   ) -> None:
        """Fold staged gradients into ``block``
        (:func:`~normwatch.measure.state.grad_fold.fold_grads`)."""

    def sample(self, samples: list[torch.Tensor], scales: list[float]) -> Sample | None:
        """The update monitor's sample of ``samples`` (one device and dtype) measured
        here, or ``None``: torch's (:class:`~normwatch.measure.optimizer.updates.Pack`)."""

    def sampler(self, params: list[torch.Tensor], packs: Sequence[tuple[list[int], Sample]]
                ) -> object | None:
        """The optimizer's step hooks' work for ``params`` in native code, where every
        sample is this backend's (:class:`~normwatch.measure.backends.native.sampler.
        NativeSampler`), or ``None``: the update monitor's Python."""

    def check(self, rows: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
              ) -> torch.Tensor | None:
        """The guard's read of a step on one device, in a launch or two: ``[|g|² of
        grads, NaN/inf elements in the norms' rows, NaN/inf sums of grads]`` (float64, on
        the device), or ``None``: not here (the guard's torch ops read them)."""
