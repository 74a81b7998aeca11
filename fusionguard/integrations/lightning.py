"""Lightning callback: ``Trainer(callbacks=[FusionGuardCallback(strict=...)])``.

A thin adapter over the public session object (``fusionguard.Session``, docs/integrations.md).
``FusionGuardCallback`` subclasses ``lightning.pytorch.Callback``; for the older
``pytorch_lightning`` package use ``PLFusionGuardCallback`` (one class cannot subclass both
packages' ``Callback``; ``callback_class("pytorch_lightning")`` builds either). Each is built on
first use, so this module imports with either package alone.

- ``setup``: the session starts (enables fusionguard or joins the one running: the session's
  rule); each loop's start (fit, validate, test, predict) watches the module and counts afresh;
- after the first training batch (or validation / test / predict batch): one verdict line on
  rank 0; ``stop_on_dense=True`` (warn mode) sets ``trainer.should_stop``;
- ``fusionguard/dense_calls``, ``fusionguard/fused_calls``, ``fusionguard/allowed_calls``
  (``fusionguard/peak_layer_bytes`` when measured) go through ``pl_module.log``, so every
  Lightning logger gets them;
- ``on_exception``: the crash record, with the exception, before Lightning tears down, then
  the summary and the session's end (Lightning calls no callback teardown after an exception);
- ``teardown``: the summary on rank 0, then the session ends (disabling what it enabled).
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any, Dict, Optional

import fusionguard

__all__ = ["FusionGuardCallback", "PLFusionGuardCallback", "callback_class"]

if TYPE_CHECKING:  # built on first use (module __getattr__ below)
    FusionGuardCallback: type
    PLFusionGuardCallback: type

_PACKAGES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}
_BUILT: Dict[str, type] = {}
said = logging.getLogger("fusionguard")  # the verdict lines: fusionguard's own logger


class _Mixin:
    """The callback's body, the same for both packages."""

    _logger: logging.Logger

    def __init__(self, strict: Optional[bool] = None, stop_on_dense: bool = False, **options: Any) -> None:
        """strict: True raise before a dense kernel allocates, False warn, None (default) say
        nothing (what is running stands; the session's rule); stop_on_dense: warn mode, stop the
        fit (``trainer.should_stop``) after the first batch that ran dense; options: ``enable()``'s,
        e.g. ``mode="oom"``: dense calls run, except one predicted not to fit on its CUDA device."""
        super().__init__()
        if not isinstance(stop_on_dense, bool):
            raise TypeError(f"{type(self).__name__}(): stop_on_dense must be True or False, not {stop_on_dense!r}")
        self.stop_on_dense = stop_on_dense
        said_strict = {} if strict is None else {"strict": strict}
        self.session = fusionguard.Session(None, name=f"{type(self).__name__}()", **said_strict, **options)
        self._verdict_done = False
        self._stopped = False

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # start here; watch at the loop's start: Lightning builds layers in ``configure_model``
        # after ``setup`` (2.6: setup, configure_model, strategy.setup, on_fit_start)
        with self.session.guarded("setup"):
            self.session.start()
            self.session.bind(trainer)
        self._verdict_done = False

    def _loop_start(self, pl_module: Any) -> None:
        """A loop starts: watch the module as it is now, and count this loop's calls afresh."""
        with self.session.guarded("loop start"):
            # ``trainer.fit(torch.compile(module))`` compiles the module's steps around its
            # hooks: names only then (no hooks for Dynamo to trace, as for the HF Trainer)
            self.session.hooks = getattr(pl_module, "_compiler_ctx", None) is None
            self.session.start()
            self.session.follow(pl_module)
            self.session.step()
        self._verdict_done = False

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._loop_start(pl_module)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if getattr(trainer.state.fn, "value", trainer.state.fn) != "fit":  # (inside fit: the training step's window)
            self._loop_start(pl_module)

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._loop_start(pl_module)

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._loop_start(pl_module)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._loop_start(pl_module)
        self._stopped = False

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._finish(trainer)

    def _finish(self, trainer: Any, exc: Optional[BaseException] = None) -> None:
        if trainer.is_global_zero and (self.session.active or self.session.off is not None):
            with self.session.guarded("summary"):
                ok = self.session.off is not None or (exc is None and self.session.counts().dense == 0)
                self._logger.log(logging.INFO if ok else logging.WARNING, "fusionguard summary:\n%s", self.session.summary_text(exc))
        self.session.stop()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.session.crashed(exception, "lightning")
        # Lightning calls no callback teardown after an exception: ours runs here
        self._finish(trainer, exception)

    # batches
    def _batch(self, trainer: Any, pl_module: Any, label: str, on_step: bool, log: bool = True) -> None:
        if not self._verdict_done:
            self._verdict_done = True
            text, ok = self.session.verdict(label)
            if trainer.is_global_zero:
                said.log(logging.INFO if ok else logging.WARNING, text)
        if on_step:
            step = self.session.step()  # this training step's calls
            stop = self.session.dense_stop(step, f"step {trainer.global_step}") if self.stop_on_dense and not self._stopped else None
            if stop:  # (the same on every rank: every rank stops, or none)
                self._stopped = True
                if trainer.is_global_zero:
                    said.warning(stop)
                trainer.should_stop = True
        if log:
            with self.session.guarded("log"):
                for key, value in self.session.metrics().items():  # (empty when fusionguard is off)
                    pl_module.log(key, value, on_step=on_step, on_epoch=not on_step, reduce_fx="max", batch_size=1)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._batch(trainer, pl_module, f"step {max(trainer.global_step, 1)}", on_step=True)

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        if not getattr(trainer, "sanity_checking", False):
            self._batch(trainer, pl_module, "validation batch 1", on_step=False)

    def on_test_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        self._batch(trainer, pl_module, "test batch 1", on_step=False)

    def on_predict_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        self._batch(trainer, pl_module, "predict batch 1", on_step=False, log=False)  # (predict cannot log)


def callback_class(package: str = "lightning") -> type:
    """The callback class for ``package``: ``"lightning"`` or ``"pytorch_lightning"``."""
    if package not in _PACKAGES:
        raise ValueError(f"callback_class(package={package!r}): use 'lightning' or 'pytorch_lightning'")
    cls = _BUILT.get(package)
    if cls is None:
        try:
            base = importlib.import_module(_PACKAGES[package]).Callback
        except ImportError:
            raise ImportError(f"fusionguard.integrations.lightning needs {package}: pip install 'fusionguard[lightning]'") from None
        name = "FusionGuardCallback" if package == "lightning" else "PLFusionGuardCallback"
        cls = _BUILT[package] = type(
            name,
            (_Mixin, base),
            {
                "__module__": __name__,
                "__doc__": f"fusionguard inside {package}'s Trainer (module docstring).",
                "_logger": logging.getLogger(f"{_PACKAGES[package]}.callbacks.fusionguard"),
            },
        )
    return cls


def __getattr__(name: str) -> Any:
    if name == "FusionGuardCallback":
        return callback_class("lightning")
    if name == "PLFusionGuardCallback":
        return callback_class("pytorch_lightning")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
