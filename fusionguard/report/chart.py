"""The per-layer chart's numbers, once, for both pictures of it: ``--plot`` (matplotlib PNG) and
``--html`` (inline SVG). Read from the report dict only: the same rows as ``--format json``.

Memory chart (when any row has a measured peak, or a dense row a score-matrix size): per layer
and phase, the row's ``peak_delta_max``, else for a dense row its ``scores_bytes_max`` (an
estimate, drawn hatched). Without any memory figure (CPU runs, ``watch(memory=False)``): fused
and dense calls per layer and phase instead.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

PHASES = ("forward", "backward")
MAX_LAYERS = 200  # layers drawn (a hostile log may name 10^4): the rest are counted in a note
MAX_LABEL = 40  # characters of a layer's axis label


def layers(rows: List[Dict[str, Any]]) -> List[str]:
    """The rows' layers, each once, in the report's order."""
    seen: Dict[str, None] = {}
    for r in rows:
        seen.setdefault(r["layer"], None)
    return list(seen)


def shown(rows: List[Dict[str, Any]]) -> List[str]:
    """The layers drawn: the first ``MAX_LAYERS`` of ``layers``."""
    return layers(rows)[:MAX_LAYERS]


def label(text: str) -> str:
    """A layer's axis label, cut to ``MAX_LABEL`` characters."""
    return text if len(text) <= MAX_LABEL else text[: MAX_LABEL - 1] + "…"


def kind(rep: Dict[str, Any]) -> str:
    """``memory`` when the rows carry a memory figure to draw, else ``counts``."""
    rows = rep["rows"]
    measured = any(r["peak_delta_max"] is not None for r in rows)
    estimated = any(r["dense"] and r["scores_bytes_max"] is not None for r in rows)
    return "memory" if measured or estimated else "counts"


def memory_bars(rep: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One bar per (layer, phase) row with a figure (of the ``shown`` layers): ``layer``, ``index`` (the layer's position),
    ``phase``, ``value`` (bytes), ``estimated`` (the score-matrix size, no measured peak),
    ``dense``, ``cause`` (the row's most frequent cause, or None)."""
    by = {(r["layer"], r["phase"]): r for r in rep["rows"]}
    out = []
    for i, layer in enumerate(shown(rep["rows"])):
        for phase in PHASES:
            r = by.get((layer, phase))
            if r is None:
                continue
            dense = bool(r["dense"])
            value: Optional[float] = r["peak_delta_max"]
            estimated = False
            if value is None and dense and r["scores_bytes_max"] is not None:
                value, estimated = r["scores_bytes_max"], True
            if value is None:
                continue
            cause = next(iter(r["causes"])) if r["causes"] else None
            out.append({"layer": layer, "index": i, "phase": phase, "value": value, "estimated": estimated, "dense": dense, "cause": cause})
    return out


def count_bars(rep: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Per layer and (phase, fused / dense): ``layer``, ``index``, ``phase``, ``what``, ``value`` (calls)."""
    by = {(r["layer"], r["phase"]): r for r in rep["rows"]}
    out = []
    for i, layer in enumerate(shown(rep["rows"])):
        for phase in PHASES:
            for what in ("fused", "dense"):
                value = (by.get((layer, phase)) or {}).get(what) or 0
                out.append({"layer": layer, "index": i, "phase": phase, "what": what, "value": value})
    return out


def unit(top: float) -> tuple:
    """(unit name, bytes per unit) for an axis whose largest value is ``top`` bytes."""
    return ("GB", 1e9) if top >= 1e9 else (("MB", 1e6) if top >= 1e6 else ("KB", 1e3))
