"""Lightning callback: ``NormWatchCallback(**watch_options)``.

    >>> from normwatch.integrations.lightning import NormWatchCallback
    >>> trainer = lightning.pytorch.Trainer(callbacks=[NormWatchCallback(report_dir="reports")])

A thin adapter over :class:`normwatch.Watch`: attaches when fitting starts (after the
strategy wrapped the model), steps once per optimizer step (gradient-accumulation aware),
logs flat metrics through every configured logger at each flush (``flush_every`` defaults
to the trainer's ``log_every_n_steps``), writes a post-mortem on exceptions, and removes its
hooks on teardown. On several ranks each rank watches its own shard of work, writes its own
reports (rank in the folder name) and console output is left to rank 0; at each flush one
``all_gather`` of two numbers tells every rank whether any rank reached a new verdict.
Its state (step count, loss baseline) rides in checkpoints.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.hooks import RemovableHandle

from normwatch.export.crossrank import VerdictExchange
from normwatch.watching import Watch

from .common import (
    add_trainer_sinks,
    on_training_error,
    refused,
    trainer_config,
    validate,
    watch_optimizers,
)


class NormWatchCallback(pl.Callback):
    """See the module docstring; keyword options are those of :func:`normwatch.watch`."""

    def __init__(self, **watch_options: Any) -> None:
        self.options = validate(watch_options)  # bad options fail here, not mid-run
        self.watch: Watch | None = None
        self._exchange = VerdictExchange()
        self._pending_state: dict[str, Any] | None = None
        self._last_global_step = -1
        self._scaler: object = None
        self._optimizer_steps = 0
        self._step_handles: list[RemovableHandle] = []
        self._restore: list[tuple[object, str]] = []

    @property
    def remote_verdicts(self) -> list[tuple[int, str, int]]:
        """``(rank, blame, step)`` of verdicts reached on other ranks, learnt at flushes."""
        return self._exchange.remote

    @property
    def state_key(self) -> str:
        return "NormWatchCallback"

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        config = trainer_config(
            self.options, flush_every=getattr(trainer, "log_every_n_steps", 50),
            rank=trainer.global_rank, world_size=trainer.world_size,
            local_rank=trainer.local_rank, quiet=_has_rich_bar(trainer))
        model = trainer.strategy.model if trainer.strategy.model is not None else pl_module
        self.watch = Watch(model, config)

        def log(metrics: dict[str, float]) -> None:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

        add_trainer_sinks(self.watch, self._exchange, log)
        watch_optimizers(self.watch, trainer.optimizers)
        # 16-mixed: the precision plugin's GradScaler; the optimizer's step hook tells a
        # step it skipped (inf/NaN gradients) from one it took, without a sync
        self._scaler = getattr(trainer.precision_plugin, "scaler", None)
        if self._scaler is not None:
            self.watch.watch_scaler(self._scaler)
            self._step_handles = [opt.register_step_post_hook(self._optimizer_stepped)
                                  for opt in trainer.optimizers]
        if self._pending_state is not None:
            self.watch.load_state_dict(self._pending_state)
            self._pending_state = None
        self._last_global_step = trainer.global_step
        if self.watch.config.guard:
            self._refuse_bad_checkpoints(trainer)

    def _refuse_bad_checkpoints(self, trainer: pl.Trainer) -> None:
        """``guard=True``: a checkpoint is not written while an incident is open or the
        weights hold NaN/inf, and then the checkpoint callbacks remove none of the earlier
        ones at that step (the last good one stays)."""
        save, remove = trainer.save_checkpoint, trainer.strategy.remove_checkpoint
        refused_at: list[int] = []

        def save_checkpoint(filepath: Any, *args: Any, **kwargs: Any) -> None:
            if self.watch is not None and not self.watch.checkpoint_ok():
                refused_at[:] = [trainer.global_step]
                refused(self.watch, str(filepath))
                return
            save(filepath, *args, **kwargs)

        def remove_checkpoint(filepath: Any) -> None:
            if refused_at != [trainer.global_step]:
                remove(filepath)

        trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]
        trainer.strategy.remove_checkpoint = remove_checkpoint  # type: ignore[method-assign]
        self._restore = [(trainer, "save_checkpoint"), (trainer.strategy, "remove_checkpoint")]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if self.watch is not None:  # what re-runs this step, should it go wrong
            self.watch.note_batch(batch)
            self.watch.note_position(epoch=trainer.current_epoch, batch_idx=batch_idx)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        watch = self.watch
        if watch is None or trainer.global_step == self._last_global_step:
            return  # still accumulating gradients: not an optimizer step yet
        self._last_global_step = trainer.global_step
        skipped = self._scaler is not None and not self._optimizer_steps
        self._optimizer_steps = 0
        watch.step(_loss(outputs), skipped=skipped)  # a flush logs through the loggers

    def _optimizer_stepped(self, optimizer: object, args: object, kwargs: object) -> None:
        self._optimizer_steps += 1

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        on_training_error(self.watch, exception)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for owner, name in self._restore:
            vars(owner).pop(name, None)
        self._restore = []
        for handle in self._step_handles:
            handle.remove()
        self._step_handles = []
        if self.watch is not None:
            self.watch.finish()  # the steps since the last flush are judged too

    def state_dict(self) -> dict[str, Any]:
        if self.watch is not None:
            return self.watch.state_dict()
        return dict(self._pending_state or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.watch is not None:
            self.watch.load_state_dict(state_dict)
        else:
            self._pending_state = dict(state_dict)


def _loss(outputs: Any) -> torch.Tensor | None:
    if isinstance(outputs, torch.Tensor):
        return outputs.detach()
    loss = outputs.get("loss") if isinstance(outputs, dict) else None
    return loss.detach() if isinstance(loss, torch.Tensor) else None


def _has_rich_bar(trainer: pl.Trainer) -> bool:
    from lightning.pytorch.callbacks import RichProgressBar

    return isinstance(trainer.progress_bar_callback, RichProgressBar)
