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
    callback = NormWatchTrainerCallback(report_dir=str(tmp_path / "reports"), stats_every=1,
                                        fp16_limit=64.0, log_layers=True)
    trainer = Trainer(model=model, args=args, train_dataset=Ids(), callbacks=[callback])
    trainer.train()
    watch = callback.watch
    assert watch is not None and watch.closed
    assert watch.step_count == 8 and watch.config.flush_every == 2
    assert all(not m._forward_hooks for m in model.modules())
    entries = [e for e in trainer.state.log_history if "normwatch/model.norm/absmax" in e]
    assert [e["step"] for e in entries] == [2, 4, 6, 8]
    assert entries[-1]["normwatch/model.norm/rms_mean"] > 0
    absmax = entries[-1]["normwatch/model.norm/absmax"]  # headroom against the user's limit
    assert entries[-1]["normwatch/model.norm/fp16_headroom"] == pytest.approx(64.0 / absmax)
    # the Trainer's (Accelerate-wrapped) AdamW was watched: one update per optimizer step
    updates = list(watch.court.updates)
    assert [u.step for u in updates] == list(range(1, 9))
    assert all(u.update_norm > 0 and u.grad_norm > 0 for u in updates)
    assert entries[-1]["normwatch/update_norm"] == pytest.approx(updates[-1].update_norm)
    assert max(u.lr or 0 for u in updates) <= 1e-3  # linear decay from 1e-3
    # per flush: 2 optimizer steps x 2 accumulated micro-batches x 4 x 16 tokens
    snap = watch.court.history.records()[0].snapshot
    assert snap.layers["model.norm"].tokens == 2 * 2 * 4 * 16
    # the Trainer logs after on_step_end: step 2's loss rides in the next flush, labelled 2
    later = watch.court.history.records()[1].snapshot
    assert [s for s, _ in later.losses] == [2] and later.losses[0][1] > 0
    assert watch.verdicts == []
    last = watch.last_snapshot  # the last flush holds steps 7-8, not an empty extra interval
    assert last is not None and (last.first_step, last.step) == (7, 8)
    assert last.layers["model.norm"].seen


def test_torch_compile_true_logs_the_eager_numbers_without_graph_breaks(tmp_path: Path
                                                                        ) -> None:
    from torch._dynamo.utils import counters

    logged = {}
    for compiled in (False, True):
        torch.compiler.reset()
        counters.clear()
        args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, logging_steps=2,
                                 per_device_train_batch_size=4, report_to=[], use_cpu=True,
                                 save_strategy="no", learning_rate=1e-3, torch_compile=compiled)
        callback = NormWatchTrainerCallback(report_dir=None, stats_every=1)
        torch.manual_seed(0)
        trainer = Trainer(model=tiny_hf("llama"), args=args, train_dataset=Ids(),
                          callbacks=[callback])
        trainer.train()
        logged[compiled] = [{k: v for k, v in e.items() if k.startswith("normwatch/")}
                            for e in trainer.state.log_history
                            if "normwatch/absmax_max" in e]
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"]
    # the default log volume: a handful of worst-layer summaries, whatever the depth
    assert set(logged[True][0]) == {
        "normwatch/absmax_max", "normwatch/absmax_max_layer", "normwatch/fp16_headroom_min",
        "normwatch/eps_dominance_max", "normwatch/nonfinite_tokens", "normwatch/alarms/info",
        "normwatch/alarms/warning", "normwatch/alarms/critical", "normwatch/verdicts",
        "normwatch/remote_verdicts", "normwatch/grad_norm", "normwatch/update_norm",
        "normwatch/update_ratio"}
    assert len(logged[True]) == len(logged[False]) == 2
    for want, got in zip(logged[False], logged[True], strict=True):
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    torch.compiler.reset()


def test_bad_options_fail_at_construction() -> None:
    with pytest.raises(normwatch.ConfigError, match="unknown option 'flush'"):
        NormWatchTrainerCallback(flush=3)


def test_an_exception_mid_run_writes_a_post_mortem_and_removes_the_hooks(tmp_path: Path) -> None:
    model = tiny_hf("llama")
    calls = []

    def crash(module: torch.nn.Module, args: object) -> None:
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("simulated crash in layer 1")

    model.model.layers[1].register_forward_pre_hook(crash)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=8, logging_steps=2,
                             per_device_train_batch_size=4, report_to=[], use_cpu=True,
                             save_strategy="no")
    callback = NormWatchTrainerCallback(report_dir=str(tmp_path / "reports"),
                                        report_console=False)
    trainer = Trainer(model=model, args=args, train_dataset=Ids(), callbacks=[callback])
    with pytest.raises(RuntimeError, match="simulated crash in layer 1"):
        trainer.train()
    watch = callback.watch
    assert watch is not None and watch.closed
    assert all(not m._forward_hooks for m in model.modules())
    report = normwatch.load_report(watch.reports[-1])
    assert report["trigger"] == "exception" and report["step"] == 3  # three steps completed
    assert "simulated crash in layer 1" in report["exception"]["traceback"]
    assert "training_step" not in vars(trainer)  # the Trainer's own method is back
    assert [v.trigger for v in watch.verdicts] == ["exception"]


def test_the_guard_skips_poisoned_steps_and_writes_no_bad_checkpoint(tmp_path: Path) -> None:
    """NaN out of the first block's MLP from step 5 on, guard_max_skips=3: steps 5-7 are
    kept from the weights, step 8 is applied; checkpoints 6, 8 and 10 are not written."""
    from transformers import TrainerCallback

    model = tiny_hf("llama")
    bad = {"on": False}
    model.model.layers[0].mlp.register_forward_hook(
        lambda m, args, out: out * float("nan") if bad["on"] else None)

    class Plant(TrainerCallback):
        def on_step_begin(self, args: object, state: object, control: object,
                          **kwargs: object) -> None:
            bad["on"] = state.global_step + 1 >= 5  # type: ignore[attr-defined]

    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=10, logging_steps=2,
                             per_device_train_batch_size=4, report_to=[], use_cpu=True,
                             save_strategy="steps", save_steps=2, learning_rate=1e-3)
    callback = NormWatchTrainerCallback(report_dir=str(tmp_path / "reports"), guard=True,
                                        guard_max_skips=3)
    trainer = Trainer(model=model, args=args, train_dataset=Ids(), callbacks=[Plant(), callback])
    trainer.train()
    assert callback.watch is not None and callback.watch.guard is not None
    assert [(e.step, e.skipped) for e in callback.watch.guard.events] == [
        (5, True), (6, True), (7, True), (8, False), (9, False), (10, False)]
    written = sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("check"))
    assert written == ["checkpoint-2", "checkpoint-4"]
    report = normwatch.load_report(callback.watch.reports[0])
    assert report["guard"]["skipped_steps"] == [5, 6, 7]
    replay = report["replay"]  # what re-runs step 5: the Trainer had done 4 steps
    assert replay["step"] == 5 and replay["position"]["global_step"] == 4
    assert [part.split(":")[0] for part in replay["batch_fingerprint"].split()] == [
        "int64[4x16]", "int64[4x16]"]  # input_ids and labels
