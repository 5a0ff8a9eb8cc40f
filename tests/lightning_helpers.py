"""A tiny LightningModule around the toy transformer, shared by the Lightning tests and the
DDP script."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from normwatch.demos.toymodel import TinyLM, lm_loss, synthetic_batch


class Tokens(Dataset[torch.Tensor]):
    def __init__(self, n: int = 64, seq: int = 16, seed: int = 0) -> None:
        self.data = synthetic_batch(torch.Generator().manual_seed(seed), batch=n, seq=seq)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class LitLM(pl.LightningModule):
    def __init__(self, nan_at: int | None = None, nan_rank: int | None = None,
                 fail_at: int | None = None, interrupt_at: int | None = None,
                 compile: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyLM(dim=32, depth=2)
        if compile:
            self.model.compile(fullgraph=True)
        self.nan_at, self.nan_rank, self.fail_at = nan_at, nan_rank, fail_at
        self.interrupt_at = interrupt_at

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
        step = self.trainer.global_step + 1
        if self.fail_at is not None and step == self.fail_at:
            raise RuntimeError("simulated crash in training_step")
        if self.interrupt_at is not None and step == self.interrupt_at:
            raise KeyboardInterrupt  # what Ctrl-C raises
        bad = self.nan_at is not None and step >= self.nan_at and \
            self.nan_rank in (None, self.global_rank)
        self.model.blocks[1].mlp.fault = bad
        loss = lm_loss(self.model(batch), batch)
        self.log("train_loss", loss.detach(), on_step=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[torch.Tensor]:
        return DataLoader(Tokens(), batch_size=4)
