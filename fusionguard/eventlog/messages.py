"""fusionguard's human messages (what it tells you on stderr) go through the standard logger
``logging.getLogger("fusionguard")``, so they are routed or silenced the usual way.

The convention, and why: a library should normally leave output to the application (Python's
HOWTO: a ``NullHandler``), but these lines are fusionguard's user interface (the log file's path,
what could not be patched, internal errors) and were always printed. So the logger carries its
own ``_StderrHandler``, which writes each message to the *current* ``sys.stderr`` exactly as
before (the bare text) and steps aside as soon as anyone configures the logger: another handler
on it (yours, or PyTorch's under ``TORCH_LOGS=fusionguard``) or ``propagate = True`` (the root
logger's handlers then get them). ``propagate`` is False by default so that a host's own root
configuration (``basicConfig``) does not print every line a second time. This is the pattern of
CPython's ``logging.lastResort``, scoped to one logger.

    logging.getLogger("fusionguard").setLevel(logging.ERROR)     # only internal errors
    logging.getLogger("fusionguard").addHandler(my_handler)      # yours instead of stderr
    logging.getLogger("fusionguard").propagate = True            # to the root logger's handlers

Levels: INFO where the log goes, WARNING what is not guarded or not written, ERROR internal
errors; the text of each dense call that is logged in full (the warning or the error the user
gets anyway) at WARNING / ERROR, given to configured handlers only. Stdlib only: imported by
``import fusionguard`` (no torch).
"""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "fusionguard"
logger = logging.getLogger(LOGGER_NAME)


class _StderrHandler(logging.Handler):
    """fusionguard's messages on stderr, byte for byte as they always were, while the logger
    is nobody else's (see the module docstring). Never raises: stderr may be None (pythonw,
    daemons) or closed."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if getattr(record, "fusionguard_shown", False) or configured():
                return
            stream = sys.stderr
            if stream is not None:
                stream.write(record.getMessage() + getattr(record, "fusionguard_end", "\n"))
        except Exception:
            pass

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        pass


def _default_handler() -> _StderrHandler:
    """The one handler of ours on the logger (kept across re-imports, e.g. a test reload)."""
    for handler in logger.handlers:
        if type(handler).__name__ == "_StderrHandler" and type(handler).__module__ == __name__:
            return handler  # type: ignore[return-value]
    handler = _StderrHandler()
    if logger.level == logging.NOTSET and not logger.handlers:  # (what the user set before importing us stays)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    logger.addHandler(handler)
    return handler


_HANDLER = _default_handler()


def configured() -> bool:
    """Someone routed the logger: a handler besides ours, or propagation to the root logger."""
    return logger.propagate or len(logger.handlers) > 1 or _HANDLER not in logger.handlers


def say(text: str, level: int = logging.WARNING) -> None:
    """One human message (``text`` ends with its newline, as stderr has always shown it).
    Never raises."""
    try:
        if not logger.isEnabledFor(level):
            return
        end = "\n" if text.endswith("\n") else ""
        logger.log(level, text[: len(text) - len(end)], extra={"fusionguard_end": end})
    except Exception:
        pass


def dense_text(text: str, level: int) -> None:
    """A logged dense call's message, which the user already gets as a warning or an exception:
    for configured handlers only (never printed a second time on stderr)."""
    try:
        if configured() and logger.isEnabledFor(level):
            logger.log(level, text, extra={"fusionguard_shown": True})
    except Exception:
        pass
