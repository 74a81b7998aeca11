"""Frames: which file is PyTorch's, which is fusionguard's, which is the user's; where the user's
code made a call; a warning pointed at the user's line. Shared by the dense path, the fused
records, recompile pressure and ``watch()``."""

from __future__ import annotations

import functools
import os
import sys
import types
import warnings
from typing import Any, Dict, Optional

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
