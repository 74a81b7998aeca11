"""Frames: which file is PyTorch's, which is fusionguard's, which is the user's; where the user's
code made a call; a warning pointed at the user's line. Shared by the dense path, the fused
records, recompile pressure and ``watch()``."""

from __future__ import annotations

import functools
import os
import sys
import threading
import types
import warnings
from typing import Any, Dict, List, Optional, Tuple

from fusionguard.errors import DenseFallbackWarning

#: fusionguard's own package directory: its frames are never the user's.
FG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_DIR = None


def torch_dir() -> str:
    global _TORCH_DIR
    if _TORCH_DIR is None:
        import torch  # lazy: torch loads on first use, never when this module is imported

        _TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    return _TORCH_DIR


@functools.lru_cache(maxsize=4096)
def is_torch_file(filename: str) -> bool:
    return filename.startswith(torch_dir())


@functools.lru_cache(maxsize=4096)
def is_wrapt_file(filename: str) -> bool:
    """wrapt's pure-Python wrappers (no C extension, or ``WRAPT_DISABLE_EXTENSIONS=1``) are frames
    between a patched function and its caller: never the user's. (Asked only of frames that
    exist: before ``import wrapt`` no frame is wrapt's, so a cached False stays true.)"""
    path = getattr(sys.modules.get("wrapt"), "__file__", None)
    return bool(path) and filename.startswith(os.path.dirname(os.path.abspath(str(path))) + os.sep)


def is_user_file(filename: str) -> bool:
    return not is_torch_file(filename) and not filename.startswith(FG_DIR) and not filename.startswith("<") and not is_wrapt_file(filename)


def first_user_frame(f: Optional[types.FrameType]) -> Optional[types.FrameType]:
    while f is not None:
        if is_user_file(f.f_code.co_filename):
            return f
        f = f.f_back
    return None


def user_call_site(frame: Optional[types.FrameType]) -> Optional[Dict[str, Any]]:
    """The first frame outside torch and fusionguard: where the user's code made the call."""
    f = first_user_frame(frame)
    if f is None:
        return None
    return frame_site(f)


def frame_site(f: types.FrameType) -> Dict[str, Any]:
    return {"file": f.f_code.co_filename, "line": f.f_lineno, "function": f.f_code.co_name}


def warn_at_user_line(message: str, target: Optional[types.FrameType] = None, category: type = DenseFallbackWarning) -> None:
    """Point the warning at the user's line (``target``: the call site the diagnosis found, else
    looked up) so filters by module work and the output is useful. Issued through the warnings
    machinery: the user's filters decide (``-W error`` makes it an exception, as for any warning)."""
    if target is None:
        target = first_user_frame(sys._getframe(1))
    if target is None:
        warnings.warn(message, category, stacklevel=1)
        return
    # what warnings.warn(stacklevel=...) does with the frame it finds, without walking to it
    # (no module_globals: with them, warn_explicit reads the module's source on every call)
    g = target.f_globals
    registry = g.setdefault("__warningregistry__", {})
    warnings.warn_explicit(message, category, target.f_code.co_filename, target.f_lineno, g.get("__name__", "<string>"), registry)


# -- a warning issued later: raised into a trace it would break, so issued where the user runs ----

_DEFERRED = threading.local()  # per thread: [(key, warn_explicit's arguments)], the newest last


def warning_at(message: str, target: Optional[types.FrameType], category: type = DenseFallbackWarning) -> Tuple[Any, ...]:
    """``warnings.warn_explicit``'s arguments for ``message`` at ``target``'s line."""
    if target is None:
        return (message, category, "<fusionguard>", 0, "fusionguard", None)
    g = target.f_globals
    return (
        message,
        category,
        target.f_code.co_filename,
        target.f_lineno,
        g.get("__name__", "<string>"),
        g.setdefault("__warningregistry__", {}),
    )


def defer_warning(key: Any, args: Tuple[Any, ...]) -> None:
    """Keep a warning that the user's filters turned into an error while Dynamo traced (raised
    there, it would become Dynamo's ``InternalTorchDynamoError``, or make Dynamo run the frame
    eagerly): issued by ``take_deferred(key)``'s taker, at the first run of that compile's graph."""
    pending: List[Tuple[Any, Tuple[Any, ...]]] = getattr(_DEFERRED, "items", [])
    _DEFERRED.items = [*pending[-15:], (key, args)]


def take_deferred(key: Any) -> List[Tuple[Any, ...]]:
    """The warnings deferred under ``key`` (a compile id) on this thread; every other one is
    dropped (its compile ended without a graph run by us: a backend that is not Inductor)."""
    pending = getattr(_DEFERRED, "items", None)
    if not pending:
        return []
    _DEFERRED.items = []
    return [args for k, args in pending if k == key]
