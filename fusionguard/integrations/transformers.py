"""Hugging Face ``Trainer`` callback: ``Trainer(..., callbacks=[FusionGuardCallback(strict=...)])``.

From the Trainer's creation (``on_init_end``) it enables fusionguard (unless the program did: its
settings stand) and watches the model the Trainer runs, so ``train()``, ``evaluate()`` and
``predict()`` are all covered. After the first optimizer step (or the first evaluation /
prediction batch) rank 0 prints one verdict line; every ``on_log`` adds cumulative
``fusionguard/dense_calls``, ``fusionguard/fused_calls`` (and, measured on CUDA,
``fusionguard/peak_layer_bytes``). ``FusionGuardCallback.attach(trainer)`` puts the callback
first, so that the ``report_to`` loggers (TensorBoard, W&B, MLflow...) get those keys too.
docs/integrations.md.
"""

from __future__ import annotations

from typing import Any, Optional

from fusionguard.integrations._common import Session, dense_ranks, log_at, missing, stop_text

try:
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging
except ImportError:
    raise missing("transformers", "transformers") from None

from fusionguard.eventlog.messages import say
from fusionguard.core.state import internal_error

__all__ = ["FusionGuardCallback"]

# transformers' logging tree: follows its verbosity (TrainingArguments(log_level=...))
logger = hf_logging.get_logger("transformers.integrations.fusionguard")


class FusionGuardCallback(TrainerCallback):
    """fusionguard inside the Hugging Face ``Trainer``.

    strict:       raise ``DenseFallbackError`` before a dense FlexAttention kernel allocates (when this
                  callback enables fusionguard; an earlier ``fusionguard.enable()`` keeps its settings).
                  ``mode="oom"`` instead (an option): dense calls run, except one predicted not to fit
                  on its CUDA device, which raises before it allocates (the same as ``FUSIONGUARD=oom``).
    stop_on_dense: warn mode: stop training (``control.should_training_stop``) at the first step
                  that ran dense, instead of training on at dense memory.
    options:      passed to ``fusionguard.enable()`` (``log_path=...``, ``rescue=...``).
    """

    def __init__(self, strict: bool = False, stop_on_dense: bool = False, **options: Any) -> None:
        self.stop_on_dense = bool(stop_on_dense)
        self.session = Session(strict, options, type(self).__name__)
        self._verdict_done = False
        self._stopped = False
        self._training = False

    @classmethod
    def attach(cls, trainer: Any, *args: Any, **kwargs: Any) -> "FusionGuardCallback":
        """Add (or move) the callback to the *front* of ``trainer``'s callbacks and start it.

        Why: ``Trainer.log`` appends a copy of ``logs`` to ``state.log_history`` before the
        callbacks run, and the ``report_to`` loggers sit before user callbacks; first in line, the
        keys this callback adds reach every logger (and ``log_history``, which ``on_log`` updates).
        A ``FusionGuardCallback`` already in ``trainer``'s callbacks is the one moved; otherwise
        ``cls(*args, **kwargs)`` is made. Returns the callback.
        """
        handler: Any = getattr(trainer, "callback_handler", None)
        if not isinstance(getattr(handler, "callbacks", None), list):
            raise TypeError(f"FusionGuardCallback.attach(trainer): expected a transformers Trainer, got {type(trainer).__name__}")
        found = [cb for cb in handler.callbacks if isinstance(cb, FusionGuardCallback)]
        cb = found[0] if found else cls(*args, **kwargs)
        for other in found:
            handler.callbacks.remove(other)
        handler.callbacks.insert(0, cb)
        if cb.session.watch is None:  # (created after the Trainer: its on_init_end has passed)
            cb._start(trainer.args, trainer.model)
        return cb

    # lifecycle
    def _start(self, args: Any, model: Any) -> None:
        try:
            hooks = not bool(getattr(args, "torch_compile", False))
            # The Trainer compiles the model itself later (accelerate's prepare): hooks put on it
            # now would be traced by Dynamo (a longer compile, x1.3-1.5): names only, no hooks.
            self.session.start(model, hooks=hooks)
        except Exception as exc:
            if type(exc).__name__ == "DenseFallbackError":
                raise
            internal_error("transformers callback start", exc)

    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._start(args, model)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.session.watch is None:
            self._start(args, model)
        self._verdict_done = False
        self._stopped = False
        self._training = True
        self.session.mark()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._verdict_done:
            self._verdict_done = True
            self._say_verdict(state, f"step {state.global_step + 1}")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.stop_on_dense and not self._stopped:
            ranks = dense_ranks(self.session.dense_seen())  # every rank stops, or none
            if ranks:
                self._stopped = True
                text, _ = self.session.verdict(f"step {state.global_step}")
                if state.is_world_process_zero:
                    say(f"{text}\n{stop_text(ranks, f'step {state.global_step}')}\n")
                control.should_training_stop = True
        return control

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # inside train() (``eval_on_start=True`` evaluates before step 1) the first optimizer
        # step gives the verdict, with the backward in it
        if not self._verdict_done and not self._training:
            self._verdict_done = True
            self._say_verdict(state, "evaluation batch 1" if state.global_step == 0 else f"step {state.global_step}, evaluation batch 1")

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        self._next_run()

    def on_predict(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        self._next_run()

    def _next_run(self) -> None:
        """Outside train(): the next evaluate() / predict() gets its own verdict, from its own counts."""
        if not self._training:
            self._verdict_done = False
            self.session.mark()

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict] = None, **kwargs: Any) -> None:
        try:
            if logs is None:
                return
            values = self.session.metrics()
            history = state.log_history
            # Trainer.log appended {**logs, "step": ...} before calling us: the same entry gets the keys
            last = history[-1] if history else None
            logs_before = dict(logs)
            logs.update(values)
            # (Trainer.log's copy holds the same value objects: `is` also matches a NaN loss)
            if isinstance(last, dict) and all(k in last and (last[k] is v or last[k] == v) for k, v in logs_before.items()):
                last.update(values)
        except Exception as exc:
            internal_error("transformers on_log", exc)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # disable() waits for the process's exit: an evaluate() after train() stays guarded
        if state.is_world_process_zero:
            try:
                ok = not self.session.dense_seen(since_start=True)
                logger.log(log_at(ok), "fusionguard summary:\n%s", self.session.summary_text())
            except Exception as exc:
                internal_error("transformers summary", exc)
        self._training = False
        self._next_run()

    def _say_verdict(self, state: Any, label: str) -> None:
        text, ok = self.session.verdict(label)
        if state.is_world_process_zero:
            say(text + "\n", log_at(ok))
