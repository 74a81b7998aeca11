"""Lightning callback: ``Trainer(callbacks=[FusionGuardCallback(strict=...)])``.

``FusionGuardCallback`` subclasses ``lightning.pytorch.Callback``; for the older
``pytorch_lightning`` package use ``PLFusionGuardCallback`` (one class cannot subclass both
packages' ``Callback``; ``callback_class("pytorch_lightning")`` builds either). Each is built on
first use, so this module imports with either package alone.

- ``setup``: enable fusionguard (unless the program did: its settings stand) and watch the module;
- after the first training batch (or validation / test / predict batch): one verdict line on
  rank 0; ``stop_on_dense=True`` (warn mode) sets ``trainer.should_stop``;
- ``fusionguard/dense_calls``, ``fusionguard/fused_calls`` (``fusionguard/peak_layer_bytes`` when
  measured) go through ``pl_module.log``, so every Lightning logger gets them;
- ``on_exception``: the crash record, with the exception, before Lightning tears down (then
  summary and disable, as ``teardown``: Lightning calls no callback teardown after an exception);
- ``teardown``: the summary on rank 0, then disable (if this callback enabled).
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any, Dict

from fusionguard.integrations._common import DENSE, FUSED, PEAK, Session, dense_ranks, log_at, missing, stop_text
from fusionguard.eventlog.messages import say
from fusionguard.core.state import internal_error
from fusionguard.core.state import STATE
from fusionguard.eventlog import crash
import fusionguard

__all__ = ["FusionGuardCallback", "PLFusionGuardCallback", "callback_class"]

if TYPE_CHECKING:  # built on first use (module __getattr__ below)
    FusionGuardCallback: type
    PLFusionGuardCallback: type

_PACKAGES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}
_BUILT: Dict[str, type] = {}


class _Mixin:
    """The callback's body, the same for both packages."""

    _logger: logging.Logger

    def __init__(self, strict: bool = False, stop_on_dense: bool = False, **options: Any) -> None:
        """strict: raise before a dense kernel allocates; stop_on_dense: warn mode, stop the fit
        (``trainer.should_stop``) after the first batch that ran dense; options: ``enable()``'s,
        e.g. ``mode="oom"``: dense calls run, except one predicted not to fit on its CUDA device,
        which raises before it allocates (the same as ``FUSIONGUARD=oom``)."""
        super().__init__()
        self.stop_on_dense = bool(stop_on_dense)
        self.session = Session(strict, options, type(self).__name__)
        self._verdict_done = False
        self._stopped = False

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # enable here; watch at the loop's start: Lightning builds layers in ``configure_model``
        # after ``setup`` (2.6: setup, configure_model, strategy.setup, on_fit_start)
        self._start(None)
        self._verdict_done = False

    def _start(self, pl_module: Any) -> None:
        try:
            # ``trainer.fit(torch.compile(module))`` compiles the module's steps around its
            # hooks: names only then (no hooks for Dynamo to trace, as for the HF Trainer)
            compiled = getattr(pl_module, "_compiler_ctx", None) is not None
            self.session.start(pl_module, hooks=not compiled)
        except Exception as exc:
            if type(exc).__name__ == "DenseFallbackError":
                raise
            internal_error("lightning callback setup", exc)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._start(pl_module)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._start(pl_module)

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._start(pl_module)

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._start(pl_module)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._finish(trainer)

    def _finish(self, trainer: Any) -> None:
        try:
            if trainer.is_global_zero and self.session.watch is not None:
                ok = not self.session.dense_seen(since_start=True)
                self._logger.log(log_at(ok), "fusionguard summary:\n%s", self.session.summary_text())
        except Exception as exc:
            internal_error("lightning summary", exc)
        self.session.stop()
        if self.session.enabled_here:
            self.session.enabled_here = False
            fusionguard.disable()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        crash.record(exception, where="lightning")
        try:
            STATE.log.flush_sampler()
        except Exception as exc:
            internal_error("lightning flush", exc)
        # Lightning calls no callback teardown after an exception: ours runs here
        self._finish(trainer)

    # batches
    def _batch(self, trainer: Any, pl_module: Any, label: str, on_step: bool, log: bool = True) -> None:
        if not self._verdict_done:
            self._verdict_done = True
            text, ok = self.session.verdict(label)
            if trainer.is_global_zero:
                say(text + "\n", log_at(ok))
        if self.stop_on_dense and label.startswith("step") and not self._stopped:
            ranks = dense_ranks(self.session.dense_seen())  # every rank stops, or none
            if ranks:
                self._stopped = True
                if trainer.is_global_zero:
                    say(stop_text(ranks, f"step {trainer.global_step}") + "\n")
                trainer.should_stop = True
        if log:
            try:
                for key, value in self.session.metrics().items():
                    if key in (DENSE, FUSED, PEAK):
                        pl_module.log(key, value, on_step=on_step, on_epoch=not on_step, reduce_fx="max", batch_size=1)
            except Exception as exc:
                internal_error("lightning log", exc)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._verdict_done = False
        self._stopped = False
        self.session.mark()

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
            raise missing(package, "lightning") from None
        name = "FusionGuardCallback" if package == "lightning" else "PLFusionGuardCallback"
        cls = _BUILT[package] = type(name, (_Mixin, base), {
            "__module__": __name__,
            "__doc__": f"fusionguard inside {package}'s Trainer (module docstring).",
            "_logger": logging.getLogger(f"{_PACKAGES[package]}.callbacks.fusionguard"),
        })
    return cls


def __getattr__(name: str) -> Any:
    if name == "FusionGuardCallback":
        return callback_class("lightning")
    if name == "PLFusionGuardCallback":
        return callback_class("pytorch_lightning")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
