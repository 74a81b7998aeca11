"""fusionguard: see, name and stop FlexAttention's silent dense fallback.

    import fusionguard
    fusionguard.enable(strict=True)

Every FlexAttention call that really runs the dense ``sdpa_dense`` / ``sdpa_dense_backward``
kernels is logged (JSON lines) with its phase, shapes, score-matrix size, call site and cause;
strict mode raises ``DenseFallbackError`` before the dense kernel allocates. Inductor-compiled
calls are recorded at compile time (and on cache hits) as fused.
"""

from __future__ import annotations

# What this file uses, under ``_`` names: ``dir(fusionguard)`` shows the public API (``__all__``) only.
import contextlib as _contextlib
import importlib as _importlib
import sys as _sys
from typing import TYPE_CHECKING  # (by this name: type checkers and tests/test_structure.py read the block it guards)

from fusionguard import _lifecycle
from fusionguard._version import __version__
from fusionguard.core.config import UNSET as _UNSET
from fusionguard.core.state import STATE as _STATE
from fusionguard.core.state import close_allowance as _close_allowance
from fusionguard.core.state import open_allowance as _open_allowance
from fusionguard.errors import DenseFallbackError, DenseFallbackWarning

if TYPE_CHECKING:  # imported lazily: `import fusionguard` must not import torch (pytest plugin)
    import os
    from typing import Any, Dict, Iterator, List, Optional, Union

    from fusionguard._summary import Summary, export, summary
    from fusionguard.session import Session, track
    from fusionguard.watching import peak_memory_allocated, watch

_LAZY = {
    "Session": ".session",
    "Summary": "._summary",
    "export": "._summary",
    "summary": "._summary",
    "peak_memory_allocated": ".watching",
    "track": ".session",
    "watch": ".watching",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fusionguard' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    """The public API: ``__all__`` (lazy names included, before they load) and the dunders."""
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__") and n.endswith("__")})


__all__ = [
    "DenseFallbackError",
    "DenseFallbackWarning",
    "Session",
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
    "track",
    "watch",
]


def enable(
    strict: Optional[bool] = _UNSET,
    log_path: Union[str, os.PathLike, None, bool] = _UNSET,
    **options: Any,
) -> None:
    """Install the guard (idempotent: a second call reconfigures, never double-wraps).

    A second call while enabled changes only what it names and keeps the rest (the log file
    too); ``strict`` and ``mode`` are one setting (naming either replaces both). After
    ``disable()``, ``enable()`` starts from the defaults. docs/integrations.md says how this
    fits ``FUSIONGUARD=`` and ``fusionguard.track()`` (who wins: ``_lifecycle.enable_as``).

    strict:   raise ``DenseFallbackError`` before a dense FlexAttention kernel allocates;
              otherwise warn (``DenseFallbackWarning``) and log. Not named (or None): not strict,
              unless ``mode="strict"``; named with ``mode``, the two must agree.
    log_path: JSON-lines file (or a directory: one file per rank and process). Default (or None): env
              ``FUSIONGUARD_LOG``, else ``./fusionguard.jsonl`` (``fusionguard.rank{N}.jsonl`` under
              torchrun). ``False``: no file, events only in memory (``fusionguard.events()``).
              A ``str`` or ``os.PathLike`` of ``str``; bytes, ``""`` and NUL are refused.
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
              ``recompile_warn_at`` (default None: half of Dynamo's recompile limit, rounded up,
              always below it; 0: off): a frame holding FlexAttention compiled that many times
              gets one ``recompile_pressure`` event and warning, before the limit turns it dense.
              ``mask_limit`` (bytes; eager ``create_block_mask`` / ``create_mask`` builds
              estimated above it warn, or raise in strict mode, before they allocate; default
              None: 10 % of the building device's memory, read at the first build, not here),
              ``mode`` (``"warn"``, ``"strict"`` or ``"oom"``: dense calls run, except one
              predicted not to fit on its CUDA device, which raises before allocating; ``strict``
              stays False in that mode; the same words as ``FUSIONGUARD=``).
    ``FUSIONGUARD=off`` in the environment makes this a no-op (kill switch; docs/guarantees.md).
    Every argument is checked first (``TypeError`` / ``ValueError`` naming it, nothing installed);
    a failure part-way undoes everything installed before the error reaches the caller.
    """
    _lifecycle.enable_as("program", strict, log_path, **options)


def disable() -> None:
    """Remove every patch (the original objects go back), write a shutdown event, close the log."""
    with _STATE.lock:
        _lifecycle.stop()


def is_enabled() -> bool:
    """True between ``enable()`` and ``disable()``."""
    return _STATE.enabled


@_contextlib.contextmanager
def allow_dense() -> Iterator[None]:
    """Inside this block strict mode does not raise; dense events say ``allowed: true``.

    Allowed: the dense calls made inside the block, in this thread or asyncio task (and in
    contexts copied from it while it is open, e.g. ``asyncio.to_thread``); and the backward of a
    forward made inside it, wherever autograd runs that backward. Never another thread's calls.
    Leaving the block in another asyncio context than the one that entered it is fine. Opened
    inside a generator that is iterated (``for``, ``next()``, ``async for``): only that
    generator's own code, never the consumer's between its yields; a generator driven as a
    context manager (``contextlib``, a pytest fixture) covers the code inside its ``with``.
    """
    block = _open_allowance(_sys._getframe(1))
    try:
        yield
    finally:
        _close_allowance(block)  # closed in every context that holds it, this one or not


def events(kind: Optional[str] = None) -> List[Dict[str, Any]]:
    """The most recent events (bounded, newest last); ``kind`` filters on the ``event`` field."""
    if kind is not None and not isinstance(kind, str):  # (never a silent empty list)
        raise TypeError(
            f"fusionguard.events(): kind must be a str (an event's name, e.g. \"flex_call\") or None, not {type(kind).__name__}"
        )
    items = list(_STATE.log.memory)
    if kind is not None:
        items = [e for e in items if e.get("event") == kind]
    return [dict(e) for e in items]
