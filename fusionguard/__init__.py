"""fusionguard: see, name and stop FlexAttention's silent dense fallback.

    import fusionguard
    fusionguard.enable(strict=True)

Every FlexAttention call that really runs the dense ``sdpa_dense`` / ``sdpa_dense_backward``
kernels is logged (JSON lines) with its phase, shapes, score-matrix size, call site and cause;
strict mode raises ``DenseFallbackError`` before the dense kernel allocates. Inductor-compiled
calls are recorded at compile time (and on cache hits) as fused.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Union

from . import _lifecycle
from ._config import Config, check_options, resolve_log_path
from ._state import ALLOW_DENSE, STATE
from ._version import __version__
from .activate import switched_off
from .errors import DenseFallbackError, DenseFallbackWarning

if TYPE_CHECKING:  # imported lazily: `import fusionguard` must not import torch (pytest plugin)
    from ._summary import Summary, export, summary
    from .watching import peak_memory_allocated, watch

_LAZY = {
    "Summary": "._summary",
    "export": "._summary",
    "summary": "._summary",
    "peak_memory_allocated": ".watching",
    "watch": ".watching",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fusionguard' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "DenseFallbackError",
    "DenseFallbackWarning",
    "Summary",
    "__version__",
    "allow_dense",
    "disable",
    "enable",
    "events",
    "export",
    "is_enabled",
    "peak_memory_allocated",
    "summary",
    "watch",
]

def enable(
    strict: bool = False,
    log_path: Union[str, os.PathLike, None, bool] = None,
    **options: Any,
) -> None:
    """Install the guard (idempotent: a second call reconfigures, never double-wraps).

    strict:   raise ``DenseFallbackError`` before a dense FlexAttention kernel allocates;
              otherwise warn (``DenseFallbackWarning``) and log.
    log_path: JSON-lines file (or a directory: one file per rank and process). Default: env
              ``FUSIONGUARD_LOG``, else ``./fusionguard.jsonl`` (``fusionguard.rank{N}.jsonl`` under
              torchrun). ``False``: no file, events only in memory (``fusionguard.events()``).
    options:  ``fsync`` (default True: the first dense event of each call site, layer and phase
              reaches the disk before the kernel runs, repeats are written but not fsync-ed;
              ``"always"``: every one; False: none),
              ``fused_first`` / ``fused_every`` / ``keep_all`` (fused per-call events: the first 10
              per layer and phase, then a counter every 1000 calls; or all), ``dense_first`` /
              ``dense_every`` (the same for repeats of one dense call: the first 10 per call
              site, layer, phase, cause and action are logged in full, then a ``dense_calls``
              counter every 1000; a blocked call is always logged), ``log_max_bytes`` /
              ``log_backups`` (size-based rotation, off by default),
              ``max_events`` (default 10000: events kept in memory), ``rescue`` (default False:
              run eager FlexAttention calls through a fused Inductor compile instead of the dense
              kernels; logged as ``path: "rescued"``; strict mode then raises only for calls that
              cannot be rescued), ``flush_interval`` (default 0.5 s: counted calls reach the file
              within it, so a killed process loses at most that much of its counts; 0: only
              every N calls and at exit), ``log_mode`` (default 0o600: new log / crash files),
              ``mask_limit`` (bytes; eager ``create_block_mask`` / ``create_mask`` builds
              estimated above it warn, or raise in strict mode, before they allocate; default
              None: 10 % of the building device's memory, read at the first build, not here),
              ``mode`` (``"warn"``, ``"strict"`` or ``"oom"``: dense calls run, except one
              predicted not to fit on its CUDA device, which raises before allocating; ``strict``
              stays False in that mode; the same words as ``FUSIONGUARD=``).
    ``FUSIONGUARD=off`` in the environment makes this a no-op (kill switch; docs/guarantees.md).
    """
    check_options(options)
    if switched_off():  # FUSIONGUARD=off: the kill switch wins over code
        return
    with STATE.lock:
        config = Config(strict=strict, **options)
        config.log_path, log_dir = resolve_log_path(log_path)
        _lifecycle.start(config, log_dir)


def disable() -> None:
    """Remove every patch (the original objects go back), write a shutdown event, close the log."""
    with STATE.lock:
        _lifecycle.stop()


_at_exit = _lifecycle.at_exit  # (run by a multiprocessing worker as it ends: _state._worker_exit)


def is_enabled() -> bool:
    """True between ``enable()`` and ``disable()``."""
    return STATE.enabled


@contextlib.contextmanager
def allow_dense() -> Iterator[None]:
    """Inside this block strict mode does not raise; dense events say ``allowed: true``.

    A backward whose forward ran inside the block is allowed too, wherever it runs.
    """
    token = ALLOW_DENSE.set(True)
    tid = threading.get_ident()
    with STATE.lock:
        STATE.allow_threads[tid] = STATE.allow_threads.get(tid, 0) + 1
    try:
        yield
    finally:
        ALLOW_DENSE.reset(token)
        with STATE.lock:
            n = STATE.allow_threads.get(tid, 1) - 1
            if n <= 0:
                STATE.allow_threads.pop(tid, None)
            else:
                STATE.allow_threads[tid] = n


def events(kind: Optional[str] = None) -> List[Dict[str, Any]]:
    """The most recent events (bounded, newest last); ``kind`` filters on the ``event`` field."""
    items = list(STATE.log.memory)
    if kind is not None:
        items = [e for e in items if e.get("event") == kind]
    return [dict(e) for e in items]
