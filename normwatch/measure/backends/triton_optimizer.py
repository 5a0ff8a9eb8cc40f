"""The optimizer side on CUDA (anywhere in Triton's interpreter): the update monitor's
sample and the guard's check, each one launch whatever the number of tensors, reading the
tensors through a device table of their addresses.

    >>> pack = TritonPack.make(samples, scales)  # None where the kernel does not cover them
    >>> pack.store(values, unchanged=False)      # one launch: the samples' values kept
    >>> row = pack.measure(after, grads, size=True)  # a zeroed row and one launch
    >>> out = check_step(rows, grads)            # the guard's [|g|², bad rows, bad grads]

**The sample.** The torch path (:class:`~normwatch.measure.optimizer.updates.Pack`)
copies the samples into buffers, subtracts and reduces them: ~14 ops and a view per
gradient a step. Here, as the CPU's C kernel does
(:class:`~normwatch.measure.backends.native.sampler.NativePack`), one kernel walks the
same blocks of every parameter (and gradient): sums the squares of the change since the
values it kept, of the gradients and (``size``) of the parameters, each tensor's scaled by
its elements per sampled element, in float32 per program of :data:`CHUNK` sampled
elements and float64 across (atomics into the row), and keeps the values it read for the
next step (1/37 of the parameters, in their format, between steps).

**The check.** Before an optimizer step the guard asks whether a norm's rows of the step
hold NaN/inf and what the gradients' exact sum of squares is (NaN/inf exactly when an
element is, or when a program's float32 sum overflows, as torch's float32 norm does):
one launch per dtype of all of them, into one zeroed row.

A table of addresses is made on the device once (the parameters') or when the tensors
move (with ``zero_grad()`` setting gradients to ``None``, the allocator mostly gives the
same blocks back; the last :attr:`Tables.KEEP` tables are kept), by a non-blocking copy
from pinned memory: no host sync.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

import torch

from normwatch.measure.backends.triton_launch import Launch
from normwatch.measure.state.rows import dense, plain_samples

CHUNK = 1024
"""Sampled elements per program."""
_TYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
"""The parameter dtypes the sample reads (by Triton's name)."""
_CHECKED = {**_TYPES, torch.float64: "float64"}
"""The dtypes the check reads."""
GRAD, ROWS = 0, 1
"""What the check does with a tensor: sum its squares (a gradient), count its NaN/inf
elements (a norm's rows)."""
KEPT, MEASURE, SIZE, GRADS = 1, 2, 4, 8
"""The kernel's mode bits: keep the values read; sum the change against the kept ones;
sum |p|²; sum |g|²."""


def device_table(values: list[int] | list[float], dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``: on an accelerator by a non-blocking copy from
    pinned memory (the allocator keeps the pinned block until the copy has run)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class Tables:
    """Device tables made from keys (``make(key)``: the table's values), the last
    :data:`KEEP` kept: gradients set to ``None`` each step come back at a few places (the
    allocator's free blocks, taken in turn), so in steady state no table is made."""

    KEEP = 4

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._tables: dict[tuple[int, ...], torch.Tensor] = {}

    def of(self, key: tuple[int, ...], make: Callable[[tuple[int, ...]], list[int]]
           ) -> torch.Tensor:
        """The table for ``key`` (made by ``make`` where it is not kept)."""
        table = self._tables.pop(key, None)
        if table is None:
            table = device_table(make(key), torch.int64, self.device)
            if len(self._tables) >= self.KEEP:
                del self._tables[next(iter(self._tables))]
        self._tables[key] = table  # (the newest last)
        return table


def _addresses(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    return tuple(map(torch.Tensor.data_ptr, tensors))


def _starts(lengths: list[int]) -> list[int]:
    """Each tensor's first program (:data:`CHUNK` elements a program); a program finds its
    tensor by a binary search of these (:func:`_find`), so a table grows with the tensors,
    not with their elements."""
    return [0, *accumulate(-(-n // CHUNK) for n in lengths)][:-1]


def _steps(n: int) -> int:
    """The binary search's steps over ``n`` tensors."""
    return max(n - 1, 0).bit_length()


class TritonPack:
    """The samples of one device and dtype, measured by one launch per step hook; see the
    module docstring. Make it with :meth:`make`."""

    keep = True
    """Its buffer is kept between steps (then an unchanged parameter is not read again)."""

    def __init__(self, samples: list[torch.Tensor], scales: list[float]) -> None:
        first = samples[0]
        self.device = first.device
        self.samples = samples
        self._type = _TYPES[first.dtype]
        lengths = [s.numel() for s in samples]
        blocks = [(s.shape[1], s.stride(0)) if s.dim() == 2 else (CHUNK, CHUNK)
                  for s in samples]  # (a flat sample: one run of its elements)
        offsets = [0, *accumulate(lengths)][:-1]
        self._n = sum(-(-n // CHUNK) for n in lengths)
        self._tensors = len(samples)
        self._meta = device_table([v for n, (width, stride), at in zip(
            lengths, blocks, offsets, strict=True) for v in (n, width, stride, at)],
            torch.int64, self.device)
        self._scale = device_table(list(scales), torch.float64, self.device)
        self._starts = device_table(_starts(lengths), torch.int64, self.device)
        self._params = device_table([s.data_ptr() for s in samples], torch.int64, self.device)
        self._grads = Tables(self.device)
        self.kept = torch.empty(sum(lengths), dtype=first.dtype, device=self.device)
        """The values read last, samples end to end (the next step's values before)."""

    @classmethod
    def make(cls, samples: list[torch.Tensor], scales: list[float]) -> TritonPack | None:
        """A pack for ``samples`` (views of the parameters, all of one dtype and device),
        or ``None`` where the kernel cannot read them: a dtype it does not read, a sample
        that is not a plain strided view read along its last dim (its blocks of
        ``(blocks, width)``, or the whole tensor flat)."""
        first = samples[0]
        return cls(samples, scales) if first.dtype in _TYPES and plain_samples(samples) \
            else None

    def store(self, values: list[torch.Tensor] | None = None, unchanged: bool = False) -> None:
        """:meth:`~normwatch.measure.state.backend.Sample.store` into :attr:`kept`, the
        parameters read by the launch itself (``values`` unused)."""
        if not unchanged:
            self._launch(None, KEPT, self.kept)

    def measure(self, after: list[torch.Tensor] | None, grads: list[torch.Tensor] | None,
                size: bool) -> torch.Tensor:
        """:meth:`~normwatch.measure.state.backend.Sample.measure` against :attr:`kept`,
        then keep the values read (``after`` unused: the launch reads them)."""
        row = torch.zeros(3, dtype=torch.float64, device=self.device)
        self._launch(grads, KEPT | MEASURE | (SIZE if size else 0) | (GRADS if grads else 0),
                     row)
        return row

    def _launch(self, grads: list[torch.Tensor] | None, mode: int, row: torch.Tensor) -> None:
        if not self._n:  # (every sample empty)
            return
        table = self._params if grads is None else self._grads.of(_addresses(grads), list)
        launch_sample(self._params, table, self.kept, self._scale, self._meta,
                      self._starts, row, self._n, self._tensors, self._type, mode)


def launch_sample(params: torch.Tensor, grads: torch.Tensor, kept: torch.Tensor,
                  scale: torch.Tensor, meta: torch.Tensor, starts: torch.Tensor,
                  row: torch.Tensor, n: int, tensors: int, dtype: str, mode: int) -> None:
    """One launch of the sample kernel: ``n`` programs over ``tensors`` tensors
    (``starts``: each one's first program), the parameters' and the gradients' address
    tables, the ``kept`` values, each tensor's ``scale`` and ``meta`` (sample length,
    block width, elements between blocks, place in ``kept``), into ``row``
    (:data:`KEPT`, ... ``mode``)."""
    import triton.language as tl

    _SAMPLE(n, params, grads, kept, scale, meta, starts, tensors, row, KEEP=bool(mode & KEPT),
            MEASURE=bool(mode & MEASURE), SIZE=bool(mode & SIZE), GRADS=bool(mode & GRADS),
            DTYPE=getattr(tl, dtype), CHUNK=CHUNK, STEPS=_steps(tensors))


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """The sample's kernel and the check's."""
    import triton
    import triton.language as tl

    @triton.jit
    def find(starts_ptr, n, p, STEPS: tl.constexpr):
        """The tensor of program ``p``: the last of the ``n`` whose first program is at
        most ``p`` (``STEPS``: ceil(log2(n)))."""
        lo = p * 0
        hi = lo + n
        for _ in tl.static_range(STEPS):
            mid = (lo + hi) // 2
            below = tl.load(starts_ptr + mid) <= p
            lo = tl.where(below, mid, lo)
            hi = tl.where(below, hi, mid)
        return lo

    global _find  # (Triton finds a kernel's helpers among its module's globals)
    _find = find

    @triton.jit
    def sample_kernel(params_ptr, grads_ptr, kept_ptr, scale_ptr, meta_ptr, starts_ptr,
                      n_tensors, row_ptr, KEEP: tl.constexpr, MEASURE: tl.constexpr,
                      SIZE: tl.constexpr, GRADS: tl.constexpr, DTYPE: tl.constexpr,
                      CHUNK: tl.constexpr, STEPS: tl.constexpr):
        p = tl.program_id(0).to(tl.int64)
        t = _find(starts_ptr, n_tensors, p, STEPS)
        j = (p - tl.load(starts_ptr + t)) * CHUNK + tl.arange(0, CHUNK)
        length = tl.load(meta_ptr + 4 * t)
        width = tl.load(meta_ptr + 4 * t + 1)
        stride = tl.load(meta_ptr + 4 * t + 2)
        kept_at = kept_ptr + tl.load(meta_ptr + 4 * t + 3) + j
        scale = tl.load(scale_ptr + t)
        inside = j < length
        at = (j // width) * stride + j % width  # the j-th sampled element in memory
        param = tl.load(params_ptr + t).to(tl.pointer_type(DTYPE))
        value = tl.load(param + at, mask=inside, other=0.0)
        x = value.to(tl.float32)
        if MEASURE:
            change = x - tl.load(kept_at, mask=inside, other=0.0).to(tl.float32)
            tl.atomic_add(row_ptr + 1, tl.sum(change * change, 0).to(tl.float64) * scale)
        if SIZE:
            tl.atomic_add(row_ptr + 2, tl.sum(x * x, 0).to(tl.float64) * scale)
        if GRADS:
            grad = tl.load(grads_ptr + t).to(tl.pointer_type(DTYPE))
            g = tl.load(grad + at, mask=inside, other=0.0).to(tl.float32)
            tl.atomic_add(row_ptr, tl.sum(g * g, 0).to(tl.float64) * scale)
        if KEEP:
            tl.store(kept_at, value, mask=inside)

    @triton.jit
    def check_kernel(table_ptr, out_ptr, n, DTYPE: tl.constexpr, CHUNK: tl.constexpr,
                     STEPS: tl.constexpr):
        p = tl.program_id(0).to(tl.int64)
        t = _find(table_ptr + 3 * n, n, p, STEPS)
        i = (p - tl.load(table_ptr + 3 * n + t)) * CHUNK + tl.arange(0, CHUNK)
        tensor = tl.load(table_ptr + 3 * t).to(tl.pointer_type(DTYPE))
        inside = i < tl.load(table_ptr + 3 * t + 1)
        x = tl.load(tensor + i, mask=inside, other=0.0).to(tl.float32)
        if tl.load(table_ptr + 3 * t + 2) == 0:  # a gradient: its sum of squares
            total = tl.sum(x * x, 0)
            tl.atomic_add(out_ptr, total.to(tl.float64))
            tl.atomic_add(out_ptr + 2, tl.where(total < float("inf"), 0.0, 1.0).to(tl.float64))
        else:  # a norm's rows: NaN/inf elements
            bad = inside & ~(tl.abs(x) < float("inf"))
            tl.atomic_add(out_ptr + 1, tl.sum(bad.to(tl.float64), 0))

    return sample_kernel, check_kernel


_find: Any = None
"""The kernels' binary search (:func:`_kernels` defines it)."""
_CHECK_TABLES: dict[torch.device, Tables] = {}


def check_step(rows: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
               ) -> torch.Tensor | None:
    """The guard's read of a step on one device (CUDA, or the CPU in the interpreter):
    ``[|g|² of grads, NaN/inf elements in rows, programs whose gradients' sum is
    NaN/inf]`` (float64, on the device, no sync), one launch per dtype; ``None`` where the
    kernel does not read them (tensors on several devices, a dtype it does not read, a
    tensor whose elements do not fill one block of memory)."""
    tensors = [*grads, *rows]
    if not tensors:
        return None
    device = tensors[0].device
    if any(t.device != device or t.dtype not in _CHECKED or type(t) is not torch.Tensor
           or t.layout != torch.strided or not dense(t) for t in tensors):
        return None
    tables = _CHECK_TABLES.get(device)
    if tables is None:
        tables = _CHECK_TABLES[device] = Tables(device)
    out = torch.zeros(3, dtype=torch.float64, device=device)
    modes = [GRAD] * len(grads) + [ROWS] * len(rows)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        picked = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        part = [tensors[i] for i in picked]
        key = (*_addresses(part), *(t.numel() for t in part), *(modes[i] for i in picked))
        table = tables.of(key, _check_table)
        launch_check(table, out, len(part), sum(-(-t.numel() // CHUNK) for t in part),
                     _CHECKED[dtype])
    return out


def _check_table(key: tuple[int, ...]) -> list[int]:
    """A check's table from its key (addresses, lengths, modes): per tensor its address,
    length and mode, then each tensor's first program (:func:`_starts`)."""
    n = len(key) // 3
    return [*(v for i in range(n) for v in (key[i], key[n + i], key[2 * n + i])),
            *_starts(list(key[n:2 * n]))]


def launch_check(table: torch.Tensor, out: torch.Tensor, n: int, programs: int,
                 dtype: str) -> None:
    """One launch of the check kernel over the ``n`` tensors of ``table``
    (:func:`_check_table`), ``programs`` programs, into ``out``."""
    import triton.language as tl

    _CHECK(programs, table, out, n, DTYPE=getattr(tl, dtype), CHUNK=CHUNK, STEPS=_steps(n))


_SAMPLE, _CHECK = Launch(lambda: _kernels()[0]), Launch(lambda: _kernels()[1])
