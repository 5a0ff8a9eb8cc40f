"""Hugging Face ``Trainer`` callback: ``NormWatchTrainerCallback(**watch_options)``.

    >>> from normwatch.integrations.transformers import NormWatchTrainerCallback
    >>> trainer = Trainer(model, args, train_dataset=ds,
    ...                   callbacks=[NormWatchTrainerCallback(report_dir="reports")])

The same behaviour as the Lightning callback through the Trainer's events: attach at
``on_train_begin`` (to the model the Trainer trains), step at every optimizer step
(``on_step_end``; gradient accumulation is the Trainer's), take the logged loss from
``on_log``, and at each flush add flat ``normwatch/...`` metrics to the Trainer's
``state.log_history`` and to the next ``logs`` dict the callbacks after it receive.
``flush_every`` defaults to ``args.logging_steps``. Hooks are removed at ``on_train_end``.

The Trainer has no exception event: at ``on_train_begin`` the callback finds the
``Trainer`` that called it and wraps that instance's ``training_step`` (forward, loss
and backward), so that an exception there writes a post-mortem and removes the hooks
before it propagates. ``on_train_end`` restores the method.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from transformers import (
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

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


class NormWatchTrainerCallback(TrainerCallback):
    """See the module docstring; keyword options are those of :func:`normwatch.watch`."""

    def __init__(self, **watch_options: Any) -> None:
        self.options = validate(watch_options)  # bad options fail here, not mid-run
        self.watch: Watch | None = None
        self._exchange = VerdictExchange()
        self._pending: dict[str, float] = {}
        self._trainer: Trainer | None = None

    @property
    def remote_verdicts(self) -> list[tuple[int, str, int]]:
        """``(rank, blame, step)`` of verdicts reached on other ranks, learnt at flushes."""
        return self._exchange.remote

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, model: Any = None, **kwargs: Any) -> None:
        if model is None:
            return
        steps = args.logging_steps
        config = trainer_config(
            self.options, flush_every=int(steps) if steps >= 1 else 10,
            rank=args.process_index, world_size=args.world_size,
            local_rank=max(args.local_process_index, 0))
        self.watch = Watch(model, config)

        def log(metrics: dict[str, float]) -> None:
            state.log_history.append({**metrics, "step": state.global_step})
            self._pending = metrics

        add_trainer_sinks(self.watch, self._exchange, log)
        if kwargs.get("optimizer") is not None:
            watch_optimizers(self.watch, [kwargs["optimizer"]])
        self.watch.set_step(state.global_step)  # resuming: continue the step numbering
        self._guard(_calling_trainer(self))

    def _guard(self, trainer: Trainer | None) -> None:
        """Wrap ``trainer.training_step`` so that an exception reaches the watch."""
        if trainer is None:
            return
        step = trainer.training_step

        @functools.wraps(step)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            try:
                return step(*args, **kwargs)
            except BaseException as exc:
                on_training_error(self.watch, exc)
                self._release()
                raise

        trainer.training_step = training_step  # type: ignore[method-assign]
        self._trainer = trainer

    def _release(self) -> None:
        if self._trainer is not None:
            vars(self._trainer).pop("training_step", None)
            self._trainer = None

    def on_step_begin(self, args: TrainingArguments, state: TrainerState,
                      control: TrainerControl, **kwargs: Any) -> None:
        if self.watch is not None:
            self.watch.note_position(global_step=state.global_step, epoch=state.epoch or 0.0)

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        if self.watch is None:
            return
        self.watch.step()  # a flush adds to the log history
        if control.should_save and self.watch.config.guard and not self.watch.checkpoint_ok():
            control.should_save = False  # the last good checkpoint stays the last one
            refused(self.watch, f"step {state.global_step}")

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if self.watch is None or logs is None:
            return
        if "loss" in logs:
            self.watch.add_loss(logs["loss"], step=state.global_step)
        if self._pending:
            logs.update(self._pending)
            self._pending = {}

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        self._release()
        if self.watch is not None:
            self.watch.finish()


def _calling_trainer(callback: TrainerCallback) -> Trainer | None:
    """The ``Trainer`` up the call stack whose callbacks include ``callback``."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, Trainer) and callback in owner.callback_handler.callbacks:
                return owner
            frame = frame.f_back
        return None
    finally:
        del frame
