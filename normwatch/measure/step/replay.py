"""What a user needs to re-run a step: a fingerprint of its batch, where the data loader
stood, the RNG states it started from.

    >>> log = ReplayLog()
    >>> log.begin_step(7)                    # the RNG states step 7 starts from (host)
    >>> log.forward(args, kwargs)            # the first forward's integer inputs, kept
    >>> log.note(epoch=0, batch_idx=6)       # what the framework knows of the position
    >>> copied = ... log.tensors() ...       # at the flush: hashed, ride along the copy
    >>> log.resolve(copied)                  # the hashes come back
    >>> log.at(7)                            # ReplayPoint(step=7, fingerprint=..., ...)

For each integer tensor of the step's batch (Lightning) or first forward's inputs, the
fingerprint is ``sum(x_i * (2654435761 i + 1))`` over its flattened elements in int64
(wrapping), modulo ``2**31 - 1``, as ``dtype[shape]:hash`` (``int64[4x16]:0a1b2c3d``; one
per tensor, space-separated): equal batches give equal fingerprints, a changed token
changes it. A batch of contiguous CPU int64/int32 tensors is hashed as the forward begins,
on the host by the C kernel
(:func:`~normwatch.measure.backends.native.readers.batch_hash`: one call a tensor,
nothing kept). Others are hashed on their device at the flush, for the interval's
steps at once (a forward only copies its integer inputs, one op; inputs past
:data:`COPY_LIMIT` elements are hashed at once instead), and ride along the flush copy (no
sync). The RNG states are kept on the host as the step's first forward begins (a copy of
the CPU generator, and CUDA's state where it is initialised: the generator's seed and
offset, no device sync); the last :data:`KEEP` steps are kept.
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from normwatch.measure.backends.native.readers import batch_hash
from normwatch.measure.step.losses import ride_along
from normwatch.records import ReplayPoint

KEEP = 64
"""Steps whose replay points are kept."""
COPY_LIMIT = 1 << 20
"""The most elements of a step's integer inputs kept (copied) until the flush; larger
inputs are hashed in their forward."""
MULTIPLIER = 2654435761
MODULUS = 2**31 - 1


def hashed(flat: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The hash of the last dim of ``flat`` (int64): 0-d for one tensor flattened, one per
    row for alike tensors stacked."""
    return (flat * weights).sum(-1).remainder(MODULUS)


def hash_weights(n: int, device: torch.device) -> torch.Tensor:
    """``2654435761 i + 1`` for ``i < n`` (int64)."""
    return torch.arange(n, device=device, dtype=torch.int64) * MULTIPLIER + 1


def _integer_tensors(value: Any, depth: int = 0) -> Iterable[torch.Tensor]:
    """The non-empty integer tensors in ``value`` (a tensor, or tuples, lists and dicts of
    them: a batch), in order."""
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point() and not value.is_complex() and value.numel() \
                and not value.is_meta:
            yield value
    elif depth < 4 and isinstance(value, tuple | list):
        for item in value:
            yield from _integer_tensors(item, depth + 1)
    elif depth < 4 and isinstance(value, Mapping):
        for item in value.values():
            yield from _integer_tensors(item, depth + 1)


class ReplayLog:
    """Replay points of the last :data:`KEEP` steps; see the module docstring."""

    def __init__(self) -> None:
        self._points: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._step = 0
        self._hashed = False
        self._pending: list[tuple[int, torch.Tensor, list[str], bool]] = []
        """Per step, its integer inputs copied as ``(tensors, elements)`` (alike tensors
        stacked; else one entry each), their names, and whether the entry holds their
        hashes already (inputs past :data:`COPY_LIMIT`)."""
        self._cached: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._names: dict[tuple[torch.dtype, torch.Size], str] = {}

    def begin_step(self, step: int) -> None:
        """Step ``step`` begins."""
        self._step, self._hashed = step, False
        self._points[step] = {"rng": {}, "position": {}, "fingerprint": None}
        while len(self._points) > KEEP:
            self._points.popitem(last=False)

    def forward(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """The step's first forward of the model: note the RNG states it starts from
        (what its dropout draws from) and hash its integer inputs (on their device;
        nothing read)."""
        if self._hashed:
            return
        self._hashed = True
        point = self._points.get(self._step)
        if point is not None:
            point["rng"] = rng_states()
        tensors = list(_integer_tensors((*args, *kwargs.values())))
        if not tensors:
            return
        names = [self._name(t) for t in tensors]
        on_host = [batch_hash(t) for t in tensors]  # CPU tensors: hashed now, in C
        if None not in on_host:
            if point is not None:
                point["fingerprint"] = list(zip(names, on_host, strict=True))
            return
        first = tensors[0]
        if len(tensors) > 1 and all(t.shape == first.shape and t.dtype == first.dtype and
                                    t.device == first.device for t in tensors):
            # alike (a language model's input ids and labels): one copy, hashed row by row
            self._keep(torch.stack(tensors).reshape(len(tensors), -1), names)
        else:
            for t, name in zip(tensors, names, strict=True):
                self._keep(t.reshape(1, -1).clone(), [name])

    def _keep(self, rows: torch.Tensor, names: list[str]) -> None:
        """Keep a copy of the step's inputs until the flush (past :data:`COPY_LIMIT`
        elements, their hashes)."""
        done = rows.numel() > COPY_LIMIT
        self._pending.append((self._step, hashed(rows.long(), self._weights(rows)) if done
                              else rows, names, done))

    def _name(self, t: torch.Tensor) -> str:
        """``dtype[shape]`` of ``t`` (``int64[4x16]``), made once per dtype and shape."""
        key = (t.dtype, t.shape)
        name = self._names.get(key)
        if name is None:
            if len(self._names) >= 64:
                self._names.clear()
            name = self._names[key] = \
                f"{str(t.dtype).removeprefix('torch.')}[{'x'.join(map(str, t.shape))}]"
        return name

    def _weights(self, t: torch.Tensor) -> torch.Tensor:
        """:func:`hash_weights` for ``t``'s rows, kept."""
        key = (t.shape[-1], t.device)
        weights = self._cached.get(key)
        if weights is None:
            if len(self._cached) >= 8:
                self._cached.clear()
            weights = self._cached[key] = hash_weights(*key)
        return weights

    def note(self, **position: int | float | str) -> None:
        """What the training framework knows of the step under way's data position (its
        first batch's, with gradient accumulation)."""
        point = self._points.get(self._step)
        if point is not None:
            for key, value in position.items():
                point["position"].setdefault(key, value)

    def tensors(self) -> dict[torch.device, list[torch.Tensor]]:
        """The interval's hashes, flat per device, to ride along the flush copy: the
        inputs of alike steps (one device, dtype and shape) hashed together."""
        hashes = []
        for (*_, done), members in self._groups().items():
            rows = torch.stack([self._pending[i][1] for i in members])
            hashes.append({rows.device: (rows if done else
                                         hashed(rows.long(), self._weights(rows))).double()})
        return ride_along(*hashes)

    def resolve(self, copied: Mapping[torch.device, Iterable[float]]) -> None:
        """Take the hashes back from ``copied`` (iterators are consumed), in the order
        :meth:`tensors` laid them out."""
        iters = {d: iter(v) for d, v in copied.items()}
        said: dict[int, list[str]] = {}
        for i in (i for members in self._groups().values() for i in members):
            _, rows, names, _ = self._pending[i]
            said[i] = [f"{name}:{int(next(iters[rows.device])):08x}" for name in names]
        steps: dict[int, list[str]] = {}
        for i, (step, *_) in enumerate(self._pending):  # a step's tensors in their order
            steps.setdefault(step, []).extend(said[i])
        for step, parts in steps.items():
            point = self._points.get(step)
            if point is not None:
                point["fingerprint"] = " ".join(parts)
        self._pending = []

    def _groups(self) -> dict[tuple[torch.device, torch.dtype, torch.Size, bool], list[int]]:
        """The pending entries hashed together (one device, dtype and shape, and whether
        hashed already), in the order :meth:`tensors` lays them out."""
        groups: dict[tuple[torch.device, torch.dtype, torch.Size, bool], list[int]] = {}
        for i, (_, rows, _, done) in enumerate(self._pending):
            groups.setdefault((rows.device, rows.dtype, rows.shape, done), []).append(i)
        return groups

    def at(self, step: int) -> ReplayPoint | None:
        """The replay point of ``step`` (``None``: not kept)."""
        point = self._points.get(step)
        if point is None:
            return None
        rng = {k: _encoded(v) for k, v in point["rng"].items()}
        said = point["fingerprint"]
        if isinstance(said, list):  # hashed on the host: (name, hash) pairs
            said = " ".join(f"{name}:{value:08x}" for name, value in said)
        return ReplayPoint(step, said, dict(point["position"]), rng)


def rng_states() -> dict[str, Any]:
    """The initial seed and the RNG states a step starts from, kept as they are (a copy of
    the CPU generator, CUDA's state); :func:`_encoded` writes them down when asked. The
    generator's copy is one C++ copy, where ``torch.get_rng_state()`` makes a tensor
    through the dispatcher (~70 µs at a step's first forward, against ~1 warm)."""
    cpu = torch.default_generator
    rng: dict[str, Any] = {"torch_initial_seed": cpu.initial_seed(),
                           "torch_cpu": cpu.clone_state() if hasattr(cpu, "clone_state")
                           else cpu.get_state()}
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # never without CUDA
        rng["torch_cuda"] = torch.cuda.get_rng_state()
    return rng


def _encoded(state: Any) -> str:
    """A kept RNG state as text: the seed in decimal, a state's bytes in base64."""
    if isinstance(state, int | str):
        return str(state)
    if isinstance(state, torch.Generator):
        state = state.get_state()
    return base64.b64encode(state.numpy().tobytes()).decode()
