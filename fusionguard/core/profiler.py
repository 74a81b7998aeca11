"""fusionguard's findings in ``torch.profiler``'s timeline: one labelled range around each
guarded dense call (``fusionguard: dense backward layers.3 (recompile_limit, 2.15 GB)``) and
around each run of a compiled graph holding fused FlexAttention calls
(``fusionguard: fused forward layers.0, layers.1 (2 flex calls)``).

Ranges come only from the run-time wrappers (``guard.make_dense_wrapper``'s kernel wrapper and
``fused.runs.count_runs``' graph-run wrapper), never from code Dynamo traces (it drops
``record_function`` there and warns at each compile). When no profiler records, the wrappers
pay one cheap check (``recording``: a flag read, about 0.06 us) and nothing else; the range
itself (``record_function``, about 13 us) is opened only while a profiler records. Every call
gets its range, sampled-out ones too: the log keeps the first of each kind, the trace all.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Optional, Tuple

from fusionguard.core.state import guarded, nothing
from fusionguard.eventlog.formatting import escape, human_bytes
from fusionguard.torch_internals import profiler_check

#: True while a ``torch.profiler`` (or ``torch.autograd.profiler``) records.
recording: Callable[[], bool] = profiler_check()

PREFIX = "fusionguard: "
MAX_NAME = 300  # characters of a range name; a layer list beyond it is cut with "..."
MAX_LAYERS = 8  # layers named in a fused range, then "+N more"


def _layer_text(layer: Any) -> str:
    return escape(str(layer))[:120] if layer else "unnamed"


def dense_name(event: Dict[str, Any]) -> str:
    """``fusionguard: dense backward layers.3 (recompile_limit, 2.15 GB)``; ``blocked`` or
    ``allowed`` after the layer when strict mode blocked it or ``allow_dense()`` let it run."""
    state = {"raise": " blocked", "allow": " allowed"}.get(event.get("action") or "", "")
    size = human_bytes(event.get("scores_bytes"), unknown="unknown size")
    cause = escape(str(event.get("cause") or "unknown"))
    return f"{PREFIX}dense {event.get('phase')} {_layer_text(event.get('layer'))}{state} ({cause}, {size})"[:MAX_NAME]


def fused_name(runs: Iterable[Tuple[str, Tuple[Optional[str], ...]]]) -> str:
    """``fusionguard: fused forward layers.0, layers.1 (2 flex calls)``: one graph run, per phase
    the layers its FlexAttention calls served (in call order, each once) and the call count."""
    parts = []
    for phase, names in runs:
        seen: Dict[str, None] = {}
        for n in names:
            seen.setdefault(_layer_text(n), None)
        layers = list(seen)
        shown = ", ".join(layers[:MAX_LAYERS]) + (f", +{len(layers) - MAX_LAYERS} more" if len(layers) > MAX_LAYERS else "")
        parts.append(f"fused {phase} {shown} ({len(names)} flex call{'s' if len(names) != 1 else ''})")
    text = PREFIX + "; ".join(parts)
    return text if len(text) <= MAX_NAME else text[: MAX_NAME - 3] + "..."


def in_range(name: Callable[[], str], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` inside a profiler range named ``name()``. A failure to name or
    open the range is logged once and ``fn`` runs as it would; ``fn``'s own result or
    exception passes through untouched."""
    rf = None
    with guarded("profiler range"):
        from torch.autograd.profiler import record_function  # lazy: torch loads on first use, never when this module is imported

        opening = record_function(name())
        opening.__enter__()
        rf = opening  # (only once open: a range that failed to open is not closed)
    if rf is None:
        return fn(*args, **kwargs)
    try:
        return fn(*args, **kwargs)
    finally:
        with guarded("profiler range end"):
            rf.__exit__(None, None, None)


def mark(name: Callable[[], str]) -> None:
    """An empty range (a blocked call: nothing ran, but the timeline shows where it stopped)."""
    in_range(name, nothing)
