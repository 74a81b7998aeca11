"""Listen to Dynamo's own signals: recompile-limit hits, suppressed compile errors, skipped frames.

Two sources, both Dynamo's, neither changes the host's logging setup:
- a ``logging.Handler`` *added* to ``torch._dynamo.convert_frame`` (no level or propagation is
  touched): Dynamo logs "torch._dynamo hit config.recompile_limit ... last reason: ..." and
  "WON'T CONVERT ..." there at WARNING;
- Dynamo's per-frame compilation metrics (``torch._dynamo.utils._compilation_metrics``), read when
  a compile ends (``torch._dynamo.callback`` end callback): frames that failed or were skipped,
  with Dynamo's failure type and reason.

What is heard is kept per code location (file, first line) so a later dense call can find its
cause by walking its own stack, and is logged right away so the log shows the slide to dense in
order.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
from typing import Any, Callable, Dict, Optional, Tuple

from . import torch_internals as ti
from .patches import PatchRegistry

Key = Tuple[str, int]
_DYNAMO_LOGGER = ti.DYNAMO_CONVERT_FRAME_LOGGER  # where Dynamo logs frames it could not convert

_FUNC_INFO = re.compile(r"'(?P<name>[^']*)' \((?P<file>.*):(?P<line>\d+)\)")
_WONT_CONVERT = re.compile(r"WON'T CONVERT (?P<name>\S+) (?P<file>.+?) line (?P<line>\d+)")
_TORCH_DIR = None


def torch_dir() -> str:
    global _TORCH_DIR
    if _TORCH_DIR is None:
        import torch

        _TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    return _TORCH_DIR


@functools.lru_cache(maxsize=4096)
def is_torch_file(filename: str) -> bool:
    return filename.startswith(torch_dir())


_PUBLIC_FLEX_FILE = os.path.join("nn", "attention", "flex_attention.py")


def is_public_flex(function: object, filename: str) -> bool:
    """PyTorch's public ``flex_attention``: the frame ``torch.compile(flex_attention)`` compiles."""
    return function == "flex_attention" and filename.endswith(_PUBLIC_FLEX_FILE)


def _reportable(info: dict) -> bool:
    """Signals about the user's code, and about PyTorch's public flex_attention when the user
    compiled it directly (``torch.compile(flex_attention)``, the common pattern)."""
    return not is_torch_file(info["file"]) or is_public_flex(info.get("function"), info["file"])


def reason_summary(text: object, limit: int = 300) -> str:
    """Dynamo's multi-line graph-break text as one line: the headline and its explanation."""
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    out = lines[0]
    for ln in lines[1:]:
        if ln.startswith("Explanation:"):
            out += " - " + ln[len("Explanation:") :].strip()
            break
    return out[:limit]


class Signals:
    """What Dynamo said, per code location."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.recompile_limit: Dict[Key, dict] = {}
        self.compile_error: Dict[Key, dict] = {}
        self.frame_failure: Dict[Key, dict] = {}
        self._seen_ids: Dict[int, Any] = {}
        self._handler: Optional[logging.Handler] = None
        self._end_callback: Optional[Callable[..., None]] = None
        self.emit: Callable[..., Any] = lambda *a, **k: None
        self.on_error: Callable[[str, BaseException], None] = lambda where, exc: None

    def connect(self, emit: Callable[..., Any], on_error: Callable[[str, BaseException], None]) -> None:
        """Where what is heard goes (``emit(level, event, **fields)``) and where our own failures go."""
        self.emit = emit
        self.on_error = on_error

    # -- install / remove ---------------------------------------------------------------------
    def install(self, registry: Optional[PatchRegistry] = None) -> list:
        """Add the log handler and the compile-end callback; each one's undo goes into ``registry``."""
        installed = []
        if self._handler is None:
            handler = self._handler = _DynamoLogHandler(self)
            logger = logging.getLogger(_DYNAMO_LOGGER)
            logger.addHandler(handler)
            installed.append("logging:" + _DYNAMO_LOGGER)
            if registry is not None:
                registry.add_hook("logging:" + _DYNAMO_LOGGER, self._remove_handler, lambda: handler not in logger.handlers)
        callback_handler = ti.compile_callbacks()
        if self._end_callback is None and callback_handler is not None:
            try:
                def _on_compile_end(*_args: Any) -> None:
                    try:
                        self.read_metrics()
                    except Exception as exc:  # never disturb Dynamo
                        self.on_error("dynamo_signals.compile_end", exc)

                callback_handler.register_end_callback(_on_compile_end)
                self._end_callback = _on_compile_end
                installed.append("torch._dynamo.callback.on_compile_end")
                if registry is not None:
                    registry.add_hook(
                        "torch._dynamo.callback.on_compile_end",
                        self._remove_callback,
                        lambda: _on_compile_end not in getattr(callback_handler, "end_callbacks", ()),
                    )
            except Exception:
                pass
        try:
            for m in ti.compilation_metrics():
                self._mark_seen(m)
        except Exception:
            pass
        return installed

    def _mark_seen(self, metric: Any) -> bool:
        """True the first time a metrics record is seen (Dynamo's deque is capped: track ids)."""
        key = id(metric)
        if key in self._seen_ids:
            return False
        self._seen_ids[key] = metric  # keep it alive so its id is not reused
        while len(self._seen_ids) > 512:
            self._seen_ids.pop(next(iter(self._seen_ids)))
        return True

    def remove(self) -> None:
        with self.lock:
            self.recompile_limit.clear()
            self.compile_error.clear()
            self.frame_failure.clear()
        self._remove_handler()
        self._remove_callback()

    def _remove_handler(self) -> None:
        if self._handler is not None:
            logging.getLogger(_DYNAMO_LOGGER).removeHandler(self._handler)
            self._handler = None

    def _remove_callback(self) -> None:
        if self._end_callback is not None:
            try:
                ti.compile_callbacks().remove_end_callback(self._end_callback)
            except Exception:
                pass
            self._end_callback = None

    # -- sources ------------------------------------------------------------------------------
    def on_log_record(self, record: logging.LogRecord) -> None:
        msg = record.msg if isinstance(record.msg, str) else str(record.msg)
        if msg.startswith("torch._dynamo hit config."):
            args = record.args if isinstance(record.args, tuple) else ()
            text = record.getMessage()
            m = _FUNC_INFO.search(text)
            if not m:
                return
            limit_type = args[0] if len(args) > 0 else None
            reason = str(args[3]) if len(args) > 3 else None
            if reason is None:
                rm = re.search(r"last reason: (.*)", text)
                reason = rm.group(1) if rm else None
            info: Dict[str, Any] = {
                "function": m.group("name"),
                "file": m.group("file"),
                "line": int(m.group("line")),
                "limit_type": limit_type,
                "limit": args[1] if len(args) > 1 else None,
                "reason": reason,
            }
            with self.lock:
                self.recompile_limit[(info["file"], info["line"])] = info
            if _reportable(info):
                self.emit("warning", "recompile_limit", **info)
        elif "WON'T CONVERT" in msg:
            text = record.getMessage()
            m = _WONT_CONVERT.search(text)
            if not m:
                return
            error = None
            if record.exc_info and record.exc_info[1] is not None:
                exc = record.exc_info[1]
                text = " ".join(str(exc).split())  # Dynamo's messages span lines; keep them readable
                error = f"{type(exc).__name__}: {text}"[:400]
            info = {"function": m.group("name"), "file": m.group("file"), "line": int(m.group("line")), "error": error}
            with self.lock:
                self.compile_error[(info["file"], info["line"])] = info
            if _reportable(info):
                self.emit("warning", "compile_error", **info)

    def read_metrics(self) -> None:
        """Pick up frames Dynamo failed on or skipped since the last look."""
        try:
            metrics = ti.compilation_metrics()
        except Exception:
            return
        for m in metrics:
            if not self._mark_seen(m):
                continue
            fail_type = getattr(m, "fail_type", None)
            filename = getattr(m, "co_filename", None)
            if not fail_type or not filename:
                continue
            info = {
                "function": getattr(m, "co_name", None),
                "file": filename,
                "line": getattr(m, "co_firstlineno", None),
                "fail_type": fail_type,
                "reason": (getattr(m, "fail_reason", None) or "").strip().splitlines()[0:1],
                "break_file": getattr(m, "fail_user_frame_filename", None),
                "break_line": getattr(m, "fail_user_frame_lineno", None),
            }
            info["reason"] = info["reason"][0] if info["reason"] else None
            key = (filename, info["line"])
            with self.lock:
                self.frame_failure[key] = info
            if not is_torch_file(filename) and fail_type not in ("RecompileLimitExceeded",):
                self.emit("warning", "graph_break", **info)

    def lookup(self, filename: str, firstlineno: int) -> Tuple[Optional[str], Optional[dict]]:
        key = (filename, firstlineno)
        with self.lock:
            if key in self.recompile_limit:
                return "recompile_limit", self.recompile_limit[key]
            if key in self.compile_error:
                return "compile_error", self.compile_error[key]
            if key in self.frame_failure:
                info = self.frame_failure[key]
                if "RecompileLimit" in str(info.get("fail_type")):
                    return "recompile_limit", info
                if info.get("fail_type") == "Unsupported":
                    return "graph_break", info
                return "compile_error", info
        return None, None


class _DynamoLogHandler(logging.Handler):
    def __init__(self, signals: Signals) -> None:
        super().__init__(level=logging.WARNING)
        self._signals = signals

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._signals.on_log_record(record)
        except Exception as exc:  # never disturb Dynamo's logging
            self._signals.on_error("dynamo_signals.log_handler", exc)


SIGNALS = Signals()
