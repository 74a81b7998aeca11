"""A session's own counts and the one line said on them: ``Counts`` and ``Verdict`` (public
through ``fusionguard.session``), the per-(layer, phase) tally that ``Stats`` feeds while a session
runs (``STATE.stats.taps``), and the verdict text (which layers ran flex fused, which dense and
why, which never ran flex)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from fusionguard import torch_internals as ti
from fusionguard.core.state import STATE, internal_error
from fusionguard.core.tables import NO_LAYER

__all__ = ["ALLOWED", "DENSE", "FUSED", "PEAK", "Counts", "Tally", "Verdict", "tap", "verdict"]

#: The metric names of ``Counts.metrics()`` (and of every framework callback).
DENSE, FUSED, ALLOWED, PEAK = (
    "fusionguard/dense_calls",
    "fusionguard/fused_calls",
    "fusionguard/allowed_calls",
    "fusionguard/peak_layer_bytes",
)


@dataclass(frozen=True)
class Counts:
    """FlexAttention calls counted over a span of a session: ``dense`` (kernels that ran or were
    blocked dense, not allowed), ``fused`` (calls in compiled graphs), ``allowed`` (dense on
    purpose: ``allow_dense()``), and ``rows``: per (layer, phase) dicts with those three and
    ``causes`` ({cause: dense calls}). ``off``: why fusionguard checked nothing when they were
    taken (``FUSIONGUARD=off``, ``disable()``), else None."""

    dense: int = 0
    fused: int = 0
    allowed: int = 0
    rows: Tuple[Dict[str, Any], ...] = field(default_factory=tuple)
    off: Optional[str] = None

    def metrics(self) -> Dict[str, float]:
        """``{"fusionguard/dense_calls": ..., "fusionguard/fused_calls": ..., "fusionguard/allowed_calls": ...}``;
        empty when fusionguard was off (``off``): a dashboard gets no false 0."""
        if self.off is not None:
            return {}
        return {DENSE: float(self.dense), FUSED: float(self.fused), ALLOWED: float(self.allowed)}


class Verdict(NamedTuple):
    """One line on a span of calls (``text``) and whether it is all fused (``ok``)."""

    text: str
    ok: bool


class Tally:
    """The calls counted since a point: fed by ``Stats`` (``STATE.stats.taps``) under its lock."""

    def __init__(self) -> None:
        self.rows: Dict[Tuple[str, str], List[Any]] = {}  # (layer, phase) -> [dense, fused, allowed, {cause: n}]

    def _row(self, layer: str, phase: str) -> List[Any]:
        row = self.rows.get((layer, phase))
        if row is None:
            row = self.rows[(layer, phase)] = [0, 0, 0, {}]
        return row

    def on_dense(self, layer: str, phase: str, cause: Optional[str], allowed: bool) -> None:
        row = self._row(layer, phase)
        if allowed:
            row[2] += 1
            return
        row[0] += 1
        if cause:
            row[3][cause] = row[3].get(cause, 0) + 1

    def on_fused(self, layer: str, phase: str, n: int) -> None:
        self._row(layer, phase)[1] += n

    def counts(self, off: Optional[str] = None) -> Counts:
        with STATE.stats.lock:
            items = [(k, list(v[:3]) + [dict(v[3])]) for k, v in self.rows.items()]
        rows = tuple(
            {"layer": layer, "phase": phase, "dense": d, "fused": f, "allowed": a, "calls": d + f + a, "causes": c}
            for (layer, phase), (d, f, a, c) in sorted(items, key=lambda kv: (kv[0][0] == NO_LAYER, kv[0]))
        )
        return Counts(sum(r["dense"] for r in rows), sum(r["fused"] for r in rows), sum(r["allowed"] for r in rows), rows, off)


def tap(tally: Tally, on: bool, instead_of: Optional[Tally] = None) -> None:
    stats = STATE.stats
    with stats.lock:
        taps = tuple(t for t in stats.taps if t is not tally and t is not instead_of)
        stats.taps = taps + (tally,) if on else taps


def verdict(label: str, counts: Counts, model: Any) -> Verdict:
    rows = [r for r in counts.rows if r["layer"] != NO_LAYER and (r["dense"] or r["fused"] or r["allowed"])]
    layers = sorted({r["layer"] for r in rows})
    impl = ti.attn_implementation(model) if model is not None else None
    impl_text = f" (config._attn_implementation={impl!r})" if impl else ""
    if not layers:  # (calls counted under (no layer) only: said as such, never "never ran flex")
        fused_out = f"{counts.fused} fused FlexAttention call(s) outside any watched layer" if counts.fused else ""
        if counts.dense:
            also = f"; {fused_out}" if fused_out else ""
            return Verdict(f"fusionguard: {label}: {counts.dense} dense FlexAttention call(s) outside any watched layer{also}", False)
        if fused_out:
            return Verdict(f"fusionguard: {label}: {fused_out}", True)
        if counts.allowed:
            return Verdict(f"fusionguard: {label}: {counts.allowed} allowed dense FlexAttention call(s) (allow_dense()), none fused", True)
        blind = "" if ti.sees_graphs_compiled_before() else "; graphs compiled before enable() are not seen on this torch"
        return Verdict(f"fusionguard: {label}: no FlexAttention call: the model never ran flex{impl_text}{blind}", False)
    parts = [f"fusionguard: {label}: {len(layers)} FlexAttention layer{'s' if len(layers) != 1 else ''}"]
    dense_rows = [r for r in rows if r["dense"]]
    for phase in ("forward", "backward"):
        ran = [r for r in rows if r["phase"] == phase]
        if ran:
            fused = {r["layer"] for r in ran if r["fused"] and not r["dense"]}
            # (dense on purpose, ``allow_dense()``: ran, not fused, not a fault)
            allowed = {r["layer"] for r in ran if r["allowed"] and not r["dense"] and not r["fused"]}
            parts.append(f"{phase} fused {len(fused)}/{len(layers)}" + (f" ({len(allowed)} allowed dense)" if allowed else ""))
    text = ", ".join(parts)
    outside = sum(r["dense"] for r in counts.rows if r["layer"] == NO_LAYER)
    ok = not dense_rows and counts.dense == 0
    if dense_rows:
        text += "; dense: " + "; ".join(_dense_text(r) for r in dense_rows[:4])
        if len(dense_rows) > 4:
            text += f"; +{len(dense_rows) - 4} more"
    if outside:
        text += f"; +{outside} dense outside any watched layer"
    fused_outside = sum(r["fused"] for r in counts.rows if r["layer"] == NO_LAYER)
    if fused_outside:  # (a watched model's own forward calling a compiled flex_attention, say: counted, so said)
        text += f"; {fused_outside} fused FlexAttention call(s) outside any watched layer"
    never = _never_ran(layers, model)
    if never:
        ok = False
        shown = ", ".join(never[:4]) + (f", +{len(never) - 4} more" if len(never) > 4 else "")
        text += f"; never ran flex: {shown}{impl_text}"
    return Verdict(text, ok)


def _dense_text(row: Dict[str, Any]) -> str:
    causes = ", ".join(sorted(row.get("causes") or {})) or "cause unknown"
    return f"{row['layer']} {row['phase']} x{row['dense']} ({causes})"


def _never_ran(layers: List[str], model: Any) -> List[str]:
    """Modules of the same classes as the layers that ran flex, which did not."""
    if model is None:
        return []
    try:  # (not guarded(): a fresh list per call)
        from fusionguard.watching.naming import clean_name  # lazy: it imports torch

        named = {clean_name(n): m for n, m in model.named_modules()}
        classes = {type(named[name]) for name in layers if name in named}
        return sorted(n for n, m in named.items() if type(m) in classes and n not in layers)
    except Exception as exc:
        internal_error("session never-ran", exc)
        return []
