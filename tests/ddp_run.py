"""Run by test_two_process_ddp: a real 2-process DDP fit on the CPU (gloo).

Lightning's "ddp" strategy starts rank 1 by re-running this script; each rank writes
``rank<r>.json`` with what its callback saw.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger
from normwatch.integrations.lightning import NormWatchCallback

from tests.factory import exit_now
from tests.lightning_helpers import LitLM


def main(out: Path) -> None:
    warnings.filterwarnings("ignore")
    callback = NormWatchCallback(report_dir=str(out / "reports"), flush_every=1)
    trainer = pl.Trainer(
        default_root_dir=str(out), accelerator="cpu", devices=2, strategy="ddp", max_steps=8,
        logger=CSVLogger(str(out), name="logs"), log_every_n_steps=1, callbacks=[callback],
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(LitLM(nan_at=6, nan_rank=1))
    watch = callback.watch
    assert watch is not None and watch.last_snapshot is not None
    first = next(r.snapshot for r in watch.court.history)
    summary = {
        "rank": trainer.global_rank, "world_size": trainer.world_size,
        "step_count": watch.step_count,
        "tokens_per_flush": {n: s.tokens for n, s in first.layers.items()},
        "first_batch_sum": float(next(iter(trainer.train_dataloader)).sum()),
        "verdicts": [[v.trigger, v.step, v.blame] for v in watch.verdicts],
        "remote_verdicts": [list(v) for v in callback.remote_verdicts],
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    exit_now()
