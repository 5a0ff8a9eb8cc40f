"""Across ranks, at flushes only: combine raw statistics, share verdicts.

    >>> combined = combine_ranks(rows)          # every rank calls it at the same flush
    >>> remote = VerdictExchange().exchange(watch.verdicts, step)
    >>> watch.add_sink(VerdictExchange())       # or: at each regular flush

:func:`combine_ranks` gathers each layer's *raw* row (:data:`normwatch.catalog.RAW`) from
every rank in one ``all_gather`` and combines it with each column's declared reduction;
the user-facing statistics are derived afterwards (a mean over all ranks' tokens, never a
max of per-rank means). :class:`VerdictExchange` tells every rank, in one ``all_gather``
of two numbers, whether another rank reached a verdict. Both are no-ops unless
``torch.distributed`` is initialised with more than one rank.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from normwatch.catalog import RAW, combine
from normwatch.pipeline import Flush
from normwatch.records import BLAMES, Verdict

_log = logging.getLogger("normwatch")


def active() -> bool:
    """Whether a process group is up with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _gather(mine: list[list[float]]) -> list[list[list[float]]]:
    """``all_gather`` of a small float64 matrix: ``[rank][row][column]`` on the host."""
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.tensor(mine, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    out: list[list[list[float]]] = torch.stack(gathered).cpu().tolist()  # at a flush
    return out


def combine_ranks(rows: Sequence[Mapping[str, float]]) -> list[dict[str, float]]:
    """Each layer's raw row combined over all ranks (the rows of this rank if alone)."""
    if not active():
        return [dict(r) for r in rows]
    every = _gather([[row[c] for c in RAW] for row in rows]) if rows else []
    return [combine([dict(zip(RAW, rank[i], strict=True)) for rank in every])
            for i in range(len(rows))]


class VerdictExchange:
    """Learns, at flushes, of verdicts reached on other ranks."""

    def __init__(self) -> None:
        self.remote: list[tuple[int, str, int]] = []
        """``(rank, blame, step)`` of verdicts reached on other ranks."""
        self._seen = 0

    def on_flush(self, flush: Flush) -> None:
        """The watch's sink: exchange at regular flushes (every rank reaches them)."""
        if flush.regular:
            self.exchange(flush.verdicts, flush.snapshot.step)

    def on_exception(self, flush: Flush, exc: BaseException) -> None:
        pass  # a crashed rank takes no part in collectives

    def close(self) -> None:
        pass

    def exchange(self, verdicts: Sequence[Verdict], step: int) -> list[tuple[int, str, int]]:
        """Share the verdicts this rank reached since the last exchange (their count and
        the last one's blame) and return what the other ranks reported. Every rank must
        call it at the same flush."""
        new = verdicts[self._seen:]
        self._seen = len(verdicts)
        if not active():
            return []
        code = float(BLAMES.index(new[-1].blame) + 1) if new else 0.0
        me = dist.get_rank()
        found: list[tuple[int, str, int]] = []
        for rank, ((count, blame),) in enumerate(_gather([[float(len(new)), code]])):
            if rank != me and count > 0:
                name = BLAMES[int(blame) - 1] if 1 <= blame <= len(BLAMES) else "unknown"
                found.append((rank, name, step))
                _log.warning("[verdict] rank %d reached a verdict (%s) at step %d", rank,
                             name, step)
        self.remote += found
        return found
