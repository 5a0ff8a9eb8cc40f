"""Batch fingerprints of the replay record, against the hash in Python integers."""

from __future__ import annotations

import torch

from normwatch.measure.replay import ReplayLog


def python_hash(t: torch.Tensor) -> int:
    flat = t.flatten().tolist()
    return sum(x * (2654435761 * i + 1) for i, x in enumerate(flat)) % (2**31 - 1)


def fingerprint(*args: object, **kwargs: object) -> str | None:
    log = ReplayLog()
    log.begin_step(1)
    log.forward(args, kwargs)
    log.resolve({d: iter(v.tolist()) for d, v in log.tensors().items()})
    point = log.at(1)
    assert point is not None
    return point.fingerprint


def test_alike_tensors_are_hashed_together_and_each_as_alone() -> None:
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
