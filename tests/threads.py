"""Torch's intra-op thread count, set for a block and restored after it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def threads(n: int) -> Iterator[None]:
    """Run the block on ``n`` of torch's threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
