"""Run by test_one_decision_on_every_rank: 2 processes (gloo on loopback), each training
its own replica on the same batches; only rank 1's batch of step 5 holds a NaN. Each
rank saves its parameters to ``rank<r>.pt``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import normwatch
from tests.measure.optimizer.test_guard import BAD, OPTIMIZERS, batches, mlp


def worker(rank: int, out: Path, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = mlp(torch.float32)
    opt = OPTIMIZERS["adamw"](list(model.parameters()))
    w = normwatch.watch(model, opt, guard=True, report_dir=None, flush_every=3)
    for x, y in batches(torch.float32, {BAD} if rank == 1 else set()):
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        w.step(loss)
    w.finish()
    assert w.guard is not None
    torch.save({"params": [p.detach() for p in model.parameters()],
                "skipped": [e.step for e in w.guard.events if e.skipped]},
               out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(Path(sys.argv[1]), int(sys.argv[2])), nprocs=2)
