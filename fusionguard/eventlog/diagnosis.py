"""What a crash most likely was, in one line, from the exception, its frames and the last
FlexAttention event: shared by the crash hooks (a Python exception) and ``report``'s reading of
a faulthandler file (a native crash). Pure functions; no torch import."""

from __future__ import annotations

import sys
from typing import Any, Iterable, List, Optional

from fusionguard import torch_internals as ti
from fusionguard.eventlog.formatting import human_bytes
from fusionguard.eventlog.kinds import FLEX_EVENTS

# Frames that mean "inside a FlexAttention kernel" (PyTorch's dense implementation, our wrapper).
DENSE_FUNCTIONS = ti.DENSE_FUNCTIONS | {"fusionguard_dense_kernel"}
BACKWARD_FUNCTIONS = frozenset({ti.ENGINE_RUN_BACKWARD, "backward"})
MAX_MESSAGE = 2000


def last_flex(events: Iterable[dict]) -> Optional[dict]:
    """The most recent FlexAttention event of ``events`` (oldest first), or None.

    For ``last_flex_event=lambda: diagnosis.last_flex(STATE.log.memory)``: a deque is copied first
    (one C-level step, safe while other threads append)."""
    items = list(events)
    for event in reversed(items):
        if event.get("event") in FLEX_EVENTS:
            return event
    return None


def exception_name(exc_type: type) -> str:
    module = getattr(exc_type, "__module__", "") or ""
    name = str(getattr(exc_type, "__qualname__", None) or getattr(exc_type, "__name__", exc_type))
    return name if module in ("builtins", "") else f"{module}.{name}"


def is_oom(exc_type: Optional[type], message: str) -> bool:
    """CUDA's ``torch.OutOfMemoryError`` or the CPU allocator's failure (a RuntimeError)."""
    torch = sys.modules.get("torch")
    oom_type = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if exc_type is not None and oom_type is not None and isinstance(oom_type, type) and issubclass(exc_type, oom_type):
        return True
    if exc_type is not None and issubclass(exc_type, MemoryError):
        return True
    text = message.lower()
    return "out of memory" in text or "can't allocate memory" in text or "not enough memory" in text


def where_text(event: Optional[dict]) -> str:
    if not event:
        return ""
    if event.get("layer"):
        return f" of {event['layer']}"
    site = event.get("call_site")
    if isinstance(site, dict) and site.get("file"):
        return f" at {site.get('file')}:{site.get('line')} in {site.get('function')}"
    return ""


def flex_text(event: dict) -> str:
    return f"{event.get('path') or '?'} {event.get('phase') or '?'}{where_text(event)}"


def diagnose(exc_type: Optional[type], message: str, flex: Optional[dict], frames: List[Any]) -> str:
    """One line: what most likely happened, from the exception, its frames and the last
    FlexAttention event (``frames``: ``traceback.FrameSummary`` or objects with ``filename`` and
    ``name``)."""
    name = exception_name(exc_type) if exc_type is not None else "exception"
    in_dense = any(getattr(f, "name", None) in DENSE_FUNCTIONS for f in frames)
    in_backward = any(
        getattr(f, "name", None) in BACKWARD_FUNCTIONS and "torch" in str(getattr(f, "filename", "")).replace("\\", "/").split("/")
        for f in frames
    )
    last = flex or {}
    dense = last.get("path") == "dense"
    size = ""
    if dense and last.get("scores_bytes") is not None:
        size = f"; the dense score matrix is {human_bytes(last.get('scores_bytes'), unknown='of unknown size')} in fp32"
    phase = last.get("phase") or "?"
    oom = is_oom(exc_type, message)
    what = "OOM" if oom else name
    if name.endswith("DenseFallbackError"):
        cause = f" (cause {last.get('cause')})" if last.get("cause") else ""
        would = (
            f" its {human_bytes(last.get('scores_bytes'))} fp32 score matrix"
            if dense and last.get("scores_bytes") is not None
            else " anything"
        )
        return f"strict mode blocked a dense {phase}{where_text(flex)}{cause} before it allocated{would}"
    if in_dense and dense:
        return f"{what} inside dense {phase}{where_text(flex)}{size}"
    if in_dense:
        return f"{what} inside FlexAttention's dense implementation" + (f" (last FlexAttention event: {flex_text(flex)})" if flex else "")
    if dense and in_backward and phase == "backward":
        return f"{what} during backward, right after a dense backward{where_text(flex)}{size}"
    if dense:
        return f"{what} outside FlexAttention; the last FlexAttention call was a dense {phase}{where_text(flex)}{size}"
    if flex:
        verdict = "; the dense fallback is not the cause" if oom and flex.get("path") == "fused" else ""
        return f"{what} outside FlexAttention; last FlexAttention event: {flex_text(flex)}{verdict}"
    return f"{what}; no FlexAttention event was recorded before it"


def compact_flex(event: Optional[dict]) -> Optional[dict]:
    if not event:
        return None
    keys = ("event", "seq", "ts", "layer", "phase", "path", "cause", "scores_bytes", "call_site", "template", "alloc_delta", "peak_delta")
    return {k: event.get(k) for k in keys if k in event}
