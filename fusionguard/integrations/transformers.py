"""Hugging Face ``Trainer`` callback: ``Trainer(..., callbacks=[FusionGuardCallback(strict=...)])``.

A thin adapter over the public session object (``fusionguard.Session``, docs/integrations.md):
from the Trainer's creation (``on_init_end``) the session enables fusionguard or joins the one
running (the session's rule) and watches the model the Trainer runs, found from the Trainer
itself (``model_init`` replaces it at ``train()``: followed), so ``train()``, ``evaluate()`` and
``predict()`` are all covered; the session ends when the Trainer is garbage-collected (one
callback given to several Trainers: one session each). After the first optimizer step (or the
first evaluation / prediction batch, counted from its first forward) rank 0 prints one verdict
line; every ``on_log`` adds cumulative ``fusionguard/dense_calls``, ``fusionguard/fused_calls``,
``fusionguard/allowed_calls`` (and, measured on CUDA, ``fusionguard/peak_layer_bytes``).
``FusionGuardCallback.attach(trainer)`` puts the callback first, so that the ``report_to``
loggers (TensorBoard, W&B, MLflow...) get those keys too.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from typing import Any, Optional

import fusionguard

try:
    from transformers import Trainer, TrainerCallback
    from transformers.utils import logging as hf_logging
except ImportError:
    raise ImportError("fusionguard.integrations.transformers needs transformers: pip install 'fusionguard[transformers]'") from None

__all__ = ["FusionGuardCallback"]

# transformers' logging tree: follows its verbosity (TrainingArguments(log_level=...))
logger = hf_logging.get_logger("transformers.integrations.fusionguard")
said = logging.getLogger("fusionguard")  # the verdict lines: fusionguard's own logger


#: The Trainer methods that call the callbacks this adapter looks the Trainer up from.
_CALLERS = ("__init__", "train", "evaluate", "predict", "log")


def _on_stack(method: Optional[str] = None) -> Any:
    """The Trainer whose method called this callback (``method``: only that method's frame)."""
    found = _frame(method)
    return found[0] if found is not None else None


def _frame(method: Optional[str] = None) -> Any:
    """(the Trainer, the locals of its method's frame) for the innermost such frame, or None.
    Only those methods' frames are read: on Python <= 3.12, reading ``f_locals`` of a frame
    keeps a snapshot of its locals on it, and the caller's (``trainer = Trainer(...)``
    in a function) would keep a deleted Trainer, its session and its hooks alive."""
    frame = inspect.currentframe()
    while frame is not None:
        code = frame.f_code
        if code.co_name in ((method,) if method else _CALLERS) and code.co_varnames[:1] == ("self",):
            local = frame.f_locals
            if isinstance(local.get("self"), Trainer):
                return local["self"], local
        frame = frame.f_back
    return None


def _first_batch(trainer: Any, said: Any) -> bool:
    """This evaluation (or prediction) of ``trainer`` is at its first batch. evaluate() has no
    callback at its begin, and one that raised part-way never reaches ``on_evaluate``: read from
    ``evaluation_loop``'s batch index (its loop variable ``step``: 0 at the first batch of every
    evaluation, after a raised one too). A transformers that names it otherwise: ``said(trainer)``
    (this evaluation's dataloader had its verdict; a persistent one after a raised evaluation
    then stays silent)."""
    found = _frame("evaluation_loop")
    step = found[1].get("step") if found is not None and found[0] is trainer else None
    if isinstance(step, int) and not isinstance(step, bool):
        return step == 0
    return not said(trainer)


class FusionGuardCallback(TrainerCallback):
    """fusionguard inside the Hugging Face ``Trainer``.

    strict:       True: raise ``DenseFallbackError`` before a dense FlexAttention kernel allocates;
                  False: warn; None (default): say nothing, what is running stands. The
                  session's rule: this beats the launcher's ``FUSIONGUARD=``; the program's own
                  ``fusionguard.enable()`` beats this (said once). ``mode="oom"`` instead (an
                  option): dense calls run, except one predicted not to fit on its CUDA device.
    stop_on_dense: warn mode: stop training (``control.should_training_stop``) at the first step
                  that ran dense, instead of training on at dense memory.
    options:      ``enable()``'s (``log_path=...``, ``rescue=...``), checked now.
    """

    def __init__(self, strict: Optional[bool] = None, stop_on_dense: bool = False, **options: Any) -> None:
        if not isinstance(stop_on_dense, bool):
            raise TypeError(f"{type(self).__name__}(): stop_on_dense must be True or False, not {stop_on_dense!r}")
        self.stop_on_dense = stop_on_dense
        self._options = dict(options) if strict is None else {**options, "strict": strict}
        #: the session of the Trainer that called last (one callback may serve several Trainers: one session each)
        self.session = fusionguard.Session(None, name=f"{type(self).__name__}()", **self._options)
        self._sessions: Any = weakref.WeakKeyDictionary()  # Trainer -> its session, ended with it
        self._spare: Any = self.session  # made (and its arguments checked) with the callback, for the first Trainer
        self._trainer: Any = None  # weak reference to the Trainer that called last
        self._verdict_done = False  # train()'s first-step verdict
        self._said_for: Any = weakref.WeakKeyDictionary()  # Trainer -> its evaluation's dataloader (weak) whose verdict was said
        self._stopped = False

    @classmethod
    def attach(cls, trainer: Any, *args: Any, **kwargs: Any) -> "FusionGuardCallback":
        """Add the callback to the *front* of ``trainer``'s callbacks and start it.

        Why: ``Trainer.log`` appends a copy of ``logs`` to ``state.log_history`` before the
        callbacks run, and the ``report_to`` loggers sit before user callbacks; first in line, the
        keys this callback adds reach every logger. A ``FusionGuardCallback`` already in the
        Trainer is moved when no arguments are given; with arguments it is replaced by
        ``cls(*args, **kwargs)`` (its session ended), never silently kept. Returns the callback.
        """
        handler: Any = getattr(trainer, "callback_handler", None)
        if not isinstance(getattr(handler, "callbacks", None), list):
            raise TypeError(f"FusionGuardCallback.attach(trainer): expected a transformers Trainer, got {type(trainer).__name__}")
        found = [cb for cb in handler.callbacks if isinstance(cb, FusionGuardCallback)]
        cb = found[0] if found and not (args or kwargs) else cls(*args, **kwargs)
        for other in found:
            handler.callbacks.remove(other)
            session = other._sessions.get(trainer)
            if other is not cb and session is not None:  # (only this Trainer's: other Trainers may share the callback)
                session.stop()
        handler.callbacks.insert(0, cb)
        cb._start(trainer)
        return cb

    # lifecycle
    def _start(self, trainer: Any = None, args: Any = None, model: Any = None) -> None:
        with self.session.guarded("start"):
            if trainer is None:  # (the Trainer calling now first: one callback object may serve several)
                trainer = _on_stack() or (self._trainer() if self._trainer is not None else None)
            if trainer is not None:
                self._use(trainer)
                args, model = trainer.args, trainer.model
            # The Trainer compiles the model itself later (accelerate's prepare): hooks put on it
            # now would be traced by Dynamo (a longer compile): names only, no hooks.
            self.session.hooks = not bool(getattr(args, "torch_compile", False))
            if model is not None:
                self.session.follow(model)
            self.session.start()
            # evaluate() has no callback at its begin: its first batch counts from its first forward
            self.session.step_on_forward(self._evaluation_begins)

    def _use(self, trainer: Any) -> None:
        """``self.session`` becomes ``trainer``'s, made (and bound to it) at first sight."""
        session = self._sessions.get(trainer)
        if session is None:
            session, self._spare = self._spare, None
            if session is None:
                session = fusionguard.Session(None, name=self.session.name, **self._options)
            session.bind(trainer)  # the session ends with its Trainer
            self._sessions[trainer] = session
        self.session = session
        if self._trainer is None or self._trainer() is not trainer:
            self._trainer = weakref.ref(trainer)

    def _caller(self) -> bool:
        """``self.session``: the calling Trainer's (started for a Trainer seen first now: the callback
        was added after the Trainer was made). False when there is no started session to ask."""
        trainer = _on_stack()
        if trainer is not None and trainer not in self._sessions:
            self._start(trainer)
        elif trainer is not None:
            self._use(trainer)
        return self.session.active or self.session.off is not None

    def _evaluation_begins(self) -> bool:
        """``step_on_forward``'s test: the first batch's forward of an ``evaluate()`` or ``predict()``
        of a Trainer this callback serves (its verdict then counts from here), outside ``train()``."""
        trainer = _on_stack("evaluation_loop")
        return (
            trainer is not None
            and self in trainer.callback_handler.callbacks
            and _first_batch(trainer, self._said)
            and _on_stack("train") is None
        )

    def _said(self, trainer: Any) -> bool:
        """This evaluation's verdict was said (one evaluation: one eval dataloader, set by the Trainer at its begin)."""
        loader = getattr(trainer.callback_handler, "eval_dataloader", None)
        said = self._said_for.get(trainer)
        return said is not None and loader is not None and said() is loader

    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._start(None, args, model)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        # (model_init: the Trainer made a new model; the handler's ``model`` is the old one)
        self._start(None, args, model)
        self._verdict_done = False
        self._stopped = False
        if self.session.active:
            self.session.step()  # what ran before train() is not its first step's

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._verdict_done:
            self._verdict_done = True
            self._say_verdict(state, f"step {state.global_step + 1}")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if not self.session.active:
            return control
        step = self.session.step()  # this step's calls
        text = self.session.dense_stop(step, f"step {state.global_step}") if self.stop_on_dense and not self._stopped else None
        if text:  # (the same on every rank: every rank stops, or none)
            self._stopped = True
            if state.is_world_process_zero:
                said.warning(text)
            control.should_training_stop = True
        return control

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # inside train() (``eval_on_start=True`` evaluates before step 1) the first optimizer
        # step gives the verdict, with the backward in it
        trainer = _on_stack()
        if trainer is None or not _first_batch(trainer, self._said) or _on_stack("train") is not None:
            return
        loader = getattr(trainer.callback_handler, "eval_dataloader", None)
        try:
            self._said_for[trainer] = weakref.ref(loader)
        except TypeError:  # (None, or no weak references: held until the next evaluation)
            self._said_for[trainer] = lambda: loader
        seen = trainer in self._sessions  # (else started now, after this batch: no verdict on calls it did not count)
        if self._caller() and seen:
            what = "prediction" if _on_stack("predict") is not None else "evaluation"
            self._say_verdict(state, f"{what} batch 1" if state.global_step == 0 else f"step {state.global_step}, {what} batch 1")

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        self._next_run()

    def on_predict(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        self._next_run()

    def _next_run(self) -> None:
        """Outside train(): the next evaluate() / predict() gets its own verdict, from its own counts
        (a raised one never comes here: the next one's first forward starts its count anyway)."""
        if _on_stack("train") is None:
            trainer = _on_stack()
            if trainer is not None:
                self._said_for.pop(trainer, None)  # (the next one may reuse the dataloader: persistent workers)
            if self._caller() and self.session.active:
                self.session.step()

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict] = None, **kwargs: Any) -> None:
        with self.session.guarded("on_log"):
            if logs is None or not self._caller():
                return
            values = self.session.metrics()  # (empty when fusionguard is off: never a false 0)
            history = state.log_history
            # Trainer.log appended {**logs, "step": ...} before calling us: the same entry gets the keys
            last = history[-1] if history else None
            logs_before = dict(logs)
            logs.update(values)
            # (Trainer.log's copy holds the same value objects: `is` also matches a NaN loss)
            if isinstance(last, dict) and all(k in last and (last[k] is v or last[k] == v) for k, v in logs_before.items()):
                last.update(values)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # the session stays: an evaluate() after train() is guarded; it ends with the Trainer
        if state.is_world_process_zero and (self.session.active or self.session.off is not None):
            with self.session.guarded("summary"):
                ok = self.session.off is not None or self.session.counts().dense == 0
                logger.log(logging.INFO if ok else logging.WARNING, "fusionguard summary:\n%s", self.session.summary_text())
        if self.session.active:
            self.session.step()

    def _say_verdict(self, state: Any, label: str) -> None:
        text, ok = self.session.verdict(label)
        if state.is_world_process_zero:
            said.log(logging.INFO if ok else logging.WARNING, text)
