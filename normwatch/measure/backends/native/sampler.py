"""The update monitor's sample on the CPU in one call, whatever the number of tensors.

    >>> pack = NativePack.make(samples, scales)   # None where the kernel does not cover them
    >>> pack.store()                              # the sampled values before the step
    >>> row = pack.measure(None, grads, size=True)  # float64 [|g|², |Δp|², |p|²], then kept
    >>> lane = NativeSampler.make(params, packs)  # all of an optimizer's packs, in C++
    >>> lane.before(optimizer.param_groups)       # the step hooks' work, no Python line
    >>> row = lane.measure(size=True)

The torch path (:class:`normwatch.measure.optimizer.updates.Pack`) copies each tensor's
sample into buffers, subtracts and reduces them: ~1.0 ms after each step of a d=256,
4-layer Llama (39 tensors, 3.7M parameters) on this CPU. Here one C call
(``normwatch_sample`` in ``native_rows.c``, built and loaded by
:mod:`~normwatch.measure.backends.native.build`) walks the same blocks of every parameter
and its gradient, sums the squares in float64 (four lanes: one chain of adds would wait on
each add), each tensor's scaled by its elements per sampled element, and keeps the values
it read for the next step in one buffer in the parameters' format (1/37 of them, where the
torch path holds two): ~0.15 ms there. Its floor is memory latency, not arithmetic: every
sampled block is a cache line 2.4 KB from the next, a miss of its own, so the kernel
prefetches 16 blocks ahead and, past :data:`SPLIT_FROM` blocks, splits each tensor's blocks
over torch's threads, each core waiting on its own misses (the call inside that loop on 2
cores: 198 -> 147 µs). Tensors it covers: CPU, strided, float32, bfloat16 or float16,
samples that are views (dense parameters); the pointers are taken from the samples, which
hold the parameters' storage alive.

Around the kernel, the step hooks' Python checked that the parameters are the sampled
ones, whether anything wrote them since the last read, and that every gradient is laid
out like its parameter (a few µs warm, ~170 µs a step inside a training step at d=128).
:class:`NativeSampler` does all of that for an optimizer whose samples are all
NativePacks in C++ (``sampler.cpp``, in :mod:`~normwatch.measure.backends.native.lane`'s
module), and says "no" where Python's path must measure.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence

import torch

from normwatch.measure.backends.native import lane
from normwatch.measure.backends.native.build import library, pointers, threaded
from normwatch.measure.backends.native.readers import KINDS, PLAIN
from normwatch.measure.state.rows import plain_samples

MEASURE, SIZE = 1, 2
"""``normwatch_sample``'s mode bits: sum the change against the kept values; sum |p|²."""
SPLIT_FROM = 1024
"""Sampled blocks from which the kernel splits them over torch's threads (each block a
miss of ~20 ns: fewer take about as long as waking the threads)."""


class NativePack:
    """The samples of one CPU dtype, measured by one C call per hook; see the module
    docstring. Make it with :meth:`make`."""

    keep = True
    """Its buffer is kept between steps (as a :class:`~normwatch.measure.optimizer.updates.Pack`'s
    on the CPU)."""

    def __init__(self, lib: ctypes.CDLL, samples: list[torch.Tensor],
                 scales: list[float]) -> None:
        self._fn = lib.normwatch_sample
        self.samples = samples
        self.device = samples[0].device
        self._kind = KINDS[samples[0].dtype]
        shapes = [(s.shape[0], s.shape[1], s.stride(0)) if s.dim() == 2
                  else (int(s.numel() > 0), s.numel(), s.numel()) for s in samples]
        n = len(samples)
        self._blocks = (ctypes.c_int64 * n)(*(b for b, _, _ in shapes))
        self._width = (ctypes.c_int64 * n)(*(w for _, w, _ in shapes))
        self._stride = (ctypes.c_int64 * n)(*(st for _, _, st in shapes))
        self._scale = (ctypes.c_double * n)(*scales)
        self._params = pointers(samples)
        self._unused = (ctypes.c_double * 3)()
        """Where :meth:`store`'s call writes its sums (nothing is measured)."""
        self.kept = torch.empty(sum(s.numel() for s in samples), dtype=samples[0].dtype)
        """The values read last, samples end to end (the next step's values before)."""
        self._split = sum(self._blocks) >= SPLIT_FROM and threaded()
        """Whether the blocks are split over torch's threads (:data:`SPLIT_FROM`)."""

    @classmethod
    def make(cls, samples: list[torch.Tensor], scales: list[float]) -> NativePack | None:
        """A pack for ``samples`` (views of the parameters, all of one dtype), or ``None``
        where the kernel cannot read them (see the module docstring) or is unavailable."""
        first = samples[0]
        if first.device.type != "cpu" or first.dtype not in KINDS or \
                not plain_samples(samples):
            return None
        lib = library()
        return None if lib is None else cls(lib, samples, scales)

    def store(self, values: list[torch.Tensor] | None = None, unchanged: bool = False) -> None:
        """:meth:`~normwatch.measure.state.backend.Sample.store` into :attr:`kept`, the
        parameters read by the C call itself (``values`` unused)."""
        if not unchanged:
            self._call(None, 0, None)

    def measure(self, after: list[torch.Tensor] | None, grads: list[torch.Tensor] | None,
                size: bool) -> torch.Tensor:
        """:meth:`~normwatch.measure.state.backend.Sample.measure` against :attr:`kept`,
        then keep the values read (``after`` unused: the C call reads them)."""
        row = torch.empty(3, dtype=torch.float64)
        self._call(grads, MEASURE | (SIZE if size else 0), row)
        return row

    def _call(self, grads: list[torch.Tensor] | None, mode: int,
              row: torch.Tensor | None) -> None:
        out = ctypes.addressof(self._unused) if row is None else row.data_ptr()
        grads_at = None if grads is None else pointers(grads)
        self._fn(len(self.samples), self._kind, self._blocks, self._width, self._stride,
                 self._scale, self._params, grads_at, self.kept.data_ptr(), mode, out,
                 torch.get_num_threads() if self._split else 1)


class NativeSampler:
    """An optimizer's samples, every one in a :class:`NativePack`, with the step hooks'
    work around the kernel in C++ (see the module docstring). Make it with :meth:`make`;
    a copy (``deepcopy``, a pickle) gets ``None``."""

    __slots__ = ("before", "measure", "seen")

    def __init__(self, built: object, capsule: object) -> None:
        self.before = functools.partial(built.sampler_pre, capsule)  # type: ignore[attr-defined]
        """``before(param_groups)``: where the groups' trained parameters are the sampled
        ones, in place, keep their values before the step (read again unless nothing
        wrote them since the last read); ``False``: they are not (nothing done)."""
        self.measure = functools.partial(built.sampler_post, capsule)  # type: ignore[attr-defined]
        """``measure(size)``: :meth:`NativePack.measure`'s row summed over the packs, the
        gradients read from the parameters; ``None`` where one is missing or not laid
        out like its parameter (nothing done)."""
        self.seen = functools.partial(built.sampler_seen, capsule)  # type: ignore[attr-defined]
        """The parameters were just read (by Python's path): note their versions."""

    @classmethod
    def make(cls, params: Sequence[torch.Tensor],
             packs: Sequence[tuple[list[int], object]]) -> NativeSampler | None:
        """``params``' sampler, or ``None`` where there is no pack, a parameter is not a
        plain tensor (or ``Parameter``), a pack is not a :class:`NativePack` or the C++
        module is not built."""
        if not packs or any(type(p) not in PLAIN for p in params) or \
                any(not isinstance(pack, NativePack) for _, pack in packs):
            return None
        built = lane.module()
        return None if built is None else cls(built, built.sampler(params, packs))

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        return lane.nothing, ()

