"""NormWatchTrainerCallback in a real Hugging Face Trainer on a tiny random Llama."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from normwatch.integrations.transformers import NormWatchTrainerCallback
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

import normwatch
from tests.conftest import tiny_hf


class Ids(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 32, seq: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 64, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_trainer_callback_logs_normwatch_metrics(tmp_path: Path) -> None:
    model = tiny_hf("llama")
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=8, logging_steps=2,
                             per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             report_to=[], use_cpu=True, save_strategy="no",
                             learning_rate=1e-3)
    callback = NormWatchTrainerCallback(report_dir=str(tmp_path / "reports"), stats_every=1)
    trainer = Trainer(model=model, args=args, train_dataset=Ids(), callbacks=[callback])
    trainer.train()
    watch = callback.watch
    assert watch is not None and watch.closed
    assert watch.step_count == 8 and watch.config.flush_every == 2
    assert all(not m._forward_hooks for m in model.modules())
    entries = [e for e in trainer.state.log_history if "normwatch/model.norm/absmax" in e]
    assert [e["step"] for e in entries] == [2, 4, 6, 8]
    assert entries[-1]["normwatch/model.norm/rms_mean"] > 0
    # per flush: 2 optimizer steps x 2 accumulated micro-batches x 4 x 16 tokens
    snap = watch.postmortem.history.records()[0].snapshot
    assert snap.layers["model.norm"].tokens == 2 * 2 * 4 * 16
    # the Trainer logs after on_step_end: step 2's loss rides in the next flush, labelled 2
    later = watch.postmortem.history.records()[1].snapshot
    assert [s for s, _ in later.losses] == [2] and later.losses[0][1] > 0
    assert watch.verdicts == []


def test_bad_options_fail_at_construction() -> None:
    with pytest.raises(normwatch.ConfigError, match="unknown option 'flush'"):
        NormWatchTrainerCallback(flush=3)
