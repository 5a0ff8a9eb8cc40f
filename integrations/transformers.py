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
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from normwatch.config import WatchConfig
from normwatch.metrics import flat_metrics
from normwatch.watch import Watch


class NormWatchTrainerCallback(TrainerCallback):
    """See the module docstring; keyword options are those of :func:`normwatch.watch`."""

    def __init__(self, **watch_options: Any) -> None:
        WatchConfig.from_options(**watch_options)  # bad options fail here, not mid-run
        self.options = dict(watch_options)
        self.watch: Watch | None = None
        self._pending: dict[str, float] = {}

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, model: Any = None, **kwargs: Any) -> None:
        if model is None:
            return
        options = dict(self.options)
        steps = args.logging_steps
        options.setdefault("flush_every", max(1, int(steps)) if steps >= 1 else 10)
        options.setdefault("rank", args.process_index if args.world_size > 1 else None)
        if not state.is_world_process_zero:
            options["report_console"] = False
        self.watch = Watch(model, WatchConfig.from_options(**options))
        self.watch.set_step(state.global_step)  # resuming: continue the step numbering

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        if self.watch is None:
            return
        snapshot = self.watch.step()
        if snapshot is not None:
            metrics = flat_metrics(snapshot, self.watch.alarms, len(self.watch.verdicts))
            state.log_history.append({**metrics, "step": state.global_step})
            self._pending = metrics

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
        if self.watch is not None:
            self.watch.flush()
            self.watch.close()
