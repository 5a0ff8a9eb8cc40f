"""Batch fingerprints of the replay record, against the hash in Python integers."""

from __future__ import annotations

import pytest
import torch

from normwatch.measure.step import replay
from normwatch.measure.step.replay import ReplayLog


def python_hash(t: torch.Tensor) -> int:
    """The hash in Python integers: the sum wraps as int64's does, then the floored
    remainder."""
    flat = t.flatten().tolist()
    total = sum(x * (2654435761 * i + 1) for i, x in enumerate(flat)) % 2**64
    return (total - 2**64 if total >= 2**63 else total) % (2**31 - 1)


@pytest.fixture(params=["host", "device"])
def where(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Where CPU batches are hashed: on the host in the forward (the C kernel), or as
    any other device's at the flush (torch's ops; where there is no C library)."""
    if request.param == "device":
        monkeypatch.setattr(replay, "batch_hash", lambda t: None)
    return str(request.param)


def fingerprint(*args: object, **kwargs: object) -> str | None:
    log = ReplayLog()
    log.begin_step(1)
    log.forward(args, kwargs)
    log.resolve({d: iter(torch.cat(v).tolist()) for d, v in log.tensors().items()})
    point = log.at(1)
    assert point is not None
    return point.fingerprint


def test_alike_tensors_are_hashed_together_and_each_as_alone(where: str) -> None:
    """A language model's input ids and labels (alike: hashed in one pass) and a mixed
    batch (ids, a mask of another dtype, positions of another shape) hash the same as
    one tensor at a time; float tensors are left out."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50_000, (4, 16), generator=gen)
    labels = torch.randint(0, 50_000, (4, 16), generator=gen)
    assert fingerprint(input_ids=ids, labels=labels) == \
        f"int64[4x16]:{python_hash(ids):08x} int64[4x16]:{python_hash(labels):08x}"
    mask = torch.ones(4, 16, dtype=torch.int32)
    positions = torch.arange(16)
    got = fingerprint(ids, torch.randn(4, 16), mask=mask, positions=positions)
    assert got == (f"int64[4x16]:{python_hash(ids):08x} int32[4x16]:{python_hash(mask):08x} "
                   f"int64[16]:{python_hash(positions):08x}")
    changed = labels.clone()
    changed[3, 15] += 1  # one token changes the fingerprint of its tensor only
    other = fingerprint(input_ids=ids, labels=changed)
    assert other is not None and other.split()[0] == f"int64[4x16]:{python_hash(ids):08x}"
    assert other.split()[1] != f"int64[4x16]:{python_hash(labels):08x}"


def test_an_intervals_steps_hash_at_the_flush_each_as_its_own(
        monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Steps of several layouts (alike ids and labels, a longer batch, a mixed one, one
    past the copy limit: hashed in its forward) resolve at one flush, each step to its
    own batch's hashes; a batch the loop overwrites after its forward (a reused buffer)
    keeps the fingerprint of what the forward read."""
    monkeypatch.setattr(replay, "COPY_LIMIT", 100)
    gen = torch.Generator().manual_seed(1)
    log = ReplayLog()
    want: dict[int, str] = {}
    buffer = torch.zeros(2, 8, dtype=torch.int64)
    for step in range(1, 9):
        log.begin_step(step)
        ids = torch.randint(0, 1000, (2, 8) if step % 3 else (2, 12), generator=gen)
        if step == 5:  # mixed: each tensor apart
            mask = torch.ones(2, 8, dtype=torch.int32)
            log.forward((ids,), {"mask": mask})
            names = [f"int64[2x8]:{python_hash(ids):08x}", f"int32[2x8]:{python_hash(mask):08x}"]
        elif step == 7:  # past the copy limit
            big = torch.randint(0, 1000, (2, 64), generator=gen)
            log.forward((), {"input_ids": big, "labels": big + 1})
            names = [f"int64[2x64]:{python_hash(big):08x}",
                     f"int64[2x64]:{python_hash(big + 1):08x}"]
        else:
            buffer.copy_(ids[:, :8])
            log.forward((), {"input_ids": buffer, "labels": ids})
            names = [f"int64[2x8]:{python_hash(buffer):08x}",
                     f"int64[{'x'.join(map(str, ids.shape))}]:{python_hash(ids):08x}"]
            if ids.shape == buffer.shape:  # alike: one copy of both
                buffer.fill_(-1)  # the loop reuses its buffer: what the forward read counts
        want[step] = " ".join(names)
    log.resolve({d: iter(torch.cat(v).tolist()) for d, v in log.tensors().items()})
    for step, fingerprint_ in want.items():
        point = log.at(step)
        assert point is not None and point.fingerprint == fingerprint_, step


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_the_host_hash_wraps_and_floors_as_torchs_ops(dtype: torch.dtype) -> None:
    """The C kernel's hash of a CPU tensor (negative values, sums past int64 that wrap)
    is torch's ops' (the device path) and the Python integers' (wrapped as int64); what it
    does not read (another dtype, a view that is not contiguous) it leaves."""
    from normwatch.measure.backends.native.build import library
    from normwatch.measure.backends.native.readers import batch_hash

    if library() is None:
        pytest.skip("no C compiler")
    info = torch.iinfo(dtype)
    gen = torch.Generator().manual_seed(3)
    t = torch.randint(info.min, info.max, (3, 257), generator=gen, dtype=dtype)
    t[0, :4] = torch.tensor([info.min, info.max, -1, 0], dtype=dtype)
    flat = t.reshape(1, -1).long()
    expected = int(replay.hashed(flat, replay.hash_weights(flat.shape[1], flat.device)))
    assert batch_hash(t) == expected == python_hash(t)
    assert batch_hash(t[:, ::2]) is None and batch_hash(t.to(torch.int16)) is None
    assert batch_hash(torch.zeros(0, dtype=dtype)) == 0
