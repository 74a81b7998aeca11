"""``fusionguard report --plot``: the report dict as a PNG bar chart per layer (peak memory,
dense bars in red and labelled; call counts when the log has no memory figures).

Its own module because it is the one optional dependency: matplotlib is imported only when a
plot is asked for (``pip install 'fusionguard[plot]'``).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Dict, List, Optional, Tuple

from fusionguard.report import chart
from fusionguard.report.aggregate import NO_LAYER, OTHER_LAYERS
from fusionguard.report.render import escaped, fmt_duration, rank_ranges


def short_labels(layers: List[str]) -> Tuple[List[str], Optional[str]]:
    """``model.layers.7.self_attn`` ... -> ``7`` ... and the pattern ``model.layers.<N>.self_attn``,
    when the names share a dotted prefix and suffix and differ in one part."""
    names = [name for name in layers if name not in (NO_LAYER, OTHER_LAYERS)]
    if len(names) < 2:
        return list(layers), None
    split = [n.split(".") for n in names]
    pre = 0
    while all(len(p) > pre + 1 for p in split) and len({p[pre] for p in split}) == 1:
        pre += 1
    suf = 0
    while all(len(p) > pre + suf + 1 for p in split) and len({p[-1 - suf] for p in split}) == 1:
        suf += 1
    if pre + suf == 0:
        return list(layers), None
    middles = [".".join(p[pre : len(p) - suf]) for p in split]
    if any(not m for m in middles) or len(set(middles)) != len(middles):
        return list(layers), None
    short = dict(zip(names, middles))
    first = split[0]
    pattern = ".".join(first[:pre] + ["<N>"] + (first[len(first) - suf :] if suf else []))
    return [short.get(name, name) for name in layers], pattern


#: The file ``--plot`` writes into a directory.
PLOT_NAME = "fusionguard.png"


def plot_target(path: str) -> Tuple[str, str]:
    """The file ``plot(rep, path)`` writes, and its format: the extension names the format
    (``.png``, ``.svg``, ``.pdf``, ...); none: PNG, ``.png`` added (as matplotlib does); a
    directory (existing, or ending in ``/``): ``fusionguard.png`` in it. ValueError, naming the
    extension, for a format matplotlib cannot write (``p.txt``). Needs matplotlib."""
    from matplotlib.backend_bases import FigureCanvasBase  # lazy: optional, only for --plot

    path = os.fspath(path)
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        path = os.path.join(path, PLOT_NAME)
    ext = os.path.splitext(path)[1][1:]
    if not ext:
        return path + ".png", "png"
    formats = FigureCanvasBase.get_supported_filetypes()
    if ext.lower() not in formats:
        raise ValueError(f"matplotlib cannot write a .{ext} file; use one of " + ", ".join("." + f for f in sorted(formats)))
    return path, ext.lower()


def plot(rep: Dict[str, Any], path: str) -> str:
    """Per-layer forward/backward peak-memory bars, dense ones in red and labelled; without
    any memory figure in the log (CPU runs, ``watch(memory=False)``), dense and fused calls per
    layer instead, written to ``plot_target(path)``. Returns a note on what is missing ("" when
    nothing is). Layer names and causes are drawn as they are (no mathtext: a ``$`` is a dollar
    sign). Needs matplotlib (``pip install 'fusionguard[plot]'``); raises ImportError otherwise,
    ValueError for a format matplotlib cannot write, OSError for a path that cannot be written.
    The bars' numbers are ``chart``'s, as ``--html``'s chart."""
    import matplotlib.pyplot as plt  # lazy: optional, only for --plot

    path, fmt = plot_target(path)
    fig, note = figure(rep)
    try:
        fig.savefig(path, format=fmt, dpi=120)
    finally:
        plt.close(fig)
    return note


def figure(rep: Dict[str, Any]) -> Tuple[Any, str]:
    """The chart as a matplotlib figure (each bar's ``gid``: ``index|phase`` of ``chart.memory_bars``
    or ``index|phase|what`` of ``chart.count_bars``) and ``plot``'s note; the caller closes it."""
    import matplotlib  # lazy: optional, only for --plot

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # lazy: optional, only for --plot

    rep = _drawn(rep)
    measured = any(r["peak_delta_max"] is not None for r in rep["rows"])
    with plt.rc_context({"text.parse_math": False}):
        fig = _plot_memory(rep) if chart.kind(rep) == "memory" else _plot_counts(rep)
    if measured:
        return fig, ""
    if chart.kind(rep) == "memory":
        return fig, "; no measured memory in the log (CPU run or watch(memory=False)): dense bars show the score-matrix size"
    return fig, "; no memory data in the log (CPU run or watch(memory=False)): dense and fused calls per layer plotted instead"


def _drawn(rep: Dict[str, Any]) -> Dict[str, Any]:
    """What the chart reads of ``rep``, escaped: the rows of the layers it draws in full, of the
    others only the layer's name and the numbers ``chart.kind`` and ``_left_out`` count (escaping
    every row of a 10^5-row log took 2.8 s, for its first ``chart.MAX_LAYERS`` layers drawn)."""
    names = [escaped(r["layer"]) for r in rep["rows"]]  # (a hand-made report's layer may be no string)
    drawn = set(list(dict.fromkeys(names))[: chart.MAX_LAYERS])
    keep = ("phase", "dense", "peak_delta_max", "scores_bytes_max")
    rows = [escaped(r) if n in drawn else dict({k: r.get(k) for k in keep}, layer=n) for r, n in zip(rep["rows"], names)]
    return {"rows": rows, "totals": rep["totals"], "run": escaped(rep["run"])}


def _left_out(rows: List[Dict[str, Any]]) -> str:
    """The note on layers beyond ``chart.MAX_LAYERS`` (not drawn), or ""."""
    n = len(chart.layers(rows)) - chart.MAX_LAYERS
    return f"; +{n:,} more layers not drawn (all in --format json)" if n > 0 else ""


def _finish_plot(fig: Any, ax: Any, rows: list) -> Any:
    """What both charts end with: the empty-input note, the grid and the layout."""
    if not rows:
        ax.text(0.5, 0.5, "no FlexAttention layers in the input", ha="center", va="center", transform=ax.transAxes)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    with warnings.catch_warnings():  # long labels: "tight layout not applied" is no news to the reader
        warnings.simplefilter("ignore", UserWarning)
        fig.tight_layout(rect=(0, 0.03, 1, 1))
    return fig


def _plot_counts(rep: Dict[str, Any]) -> Any:
    import matplotlib.pyplot as plt  # lazy: optional, only for --plot
    from matplotlib.patches import Patch  # lazy: optional, only for --plot

    rows = rep["rows"]
    layers = chart.shown(rows)
    labels, pattern = short_labels(layers)
    labels = [chart.label(x) for x in labels]
    n = max(1, len(layers))
    fig, ax = plt.subplots(figsize=(min(20.0, max(8.5, 0.6 * n + 5)), 5.4))
    width = 0.2
    bars = [
        ("forward", "fused", "#7fa7d6"),
        ("forward", "dense", "#f08a7e"),
        ("backward", "fused", "#2c5d94"),
        ("backward", "dense", "#b3261e"),
    ]
    series = {(phase, what): j for j, (phase, what, _) in enumerate(bars)}
    for b in chart.count_bars(rep):
        j = series[(b["phase"], b["what"])]
        (rect,) = ax.bar([b["index"] + (j - 1.5) * width], [b["value"]], width=width, color=bars[j][2])
        rect.set_gid(f"{b['index']}|{b['phase']}|{b['what']}")
    ax.set_xticks(range(len(layers)))
    ax.set_xticklabels(labels, rotation=35 if len(layers) > 8 else 0, ha="right" if len(layers) > 8 else "center", fontsize=8)
    if pattern is not None:
        ax.set_xlabel(f"layer: {pattern}", fontsize=9)
    ax.set_ylabel("FlexAttention calls")
    t = rep["totals"]
    ax.set_title(
        f"fusionguard: calls per attention layer ({t['dense_calls']:,} dense, {t['fused_calls']:,} fused)", fontsize=11, loc="left"
    )
    fig.text(
        0.01,
        0.01,
        "no memory data in the log (CPU run or watch(memory=False)): call counts shown" + _left_out(rows),
        fontsize=7,
        color="#444444",
    )
    handles = [Patch(color=color, label=f"{phase}, {what}") for phase, what, color in bars]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, frameon=False)
    return _finish_plot(fig, ax, rows)


def _plot_memory(rep: Dict[str, Any]) -> Any:
    import matplotlib.pyplot as plt  # lazy: optional, only for --plot
    from matplotlib.patches import Patch  # lazy: optional, only for --plot

    rows = rep["rows"]
    layers = chart.shown(rows)
    by = {(r["layer"], r["phase"]): r for r in rows}
    bars = chart.memory_bars(rep)
    top = max((b["value"] for b in bars), default=0)
    unit, scale = chart.unit(top)
    n = max(1, len(layers))
    labels, pattern = short_labels(layers)
    labels = [chart.label(x) for x in labels]
    fig, ax = plt.subplots(figsize=(min(20.0, max(8.5, (0.6 if pattern is None else 0.3) * n + 5)), 5.4))
    width = 0.38
    colors = {
        ("forward", False): "#7fa7d6",
        ("backward", False): "#2c5d94",
        ("forward", True): "#f08a7e",
        ("backward", True): "#b3261e",
    }
    estimated = any(b["estimated"] for b in bars)
    dense_labels = []
    for b in bars:
        layer, phase, value, est, dense = b["layer"], b["phase"], b["value"], b["estimated"], b["dense"]
        x = b["index"] + (chart.PHASES.index(phase) - 0.5) * width
        (rect,) = ax.bar(
            [x],
            [value / scale],
            width=width,
            color=colors[(phase, dense)],
            edgecolor="black" if dense else "none",
            linewidth=1.2 if dense else 0,
            hatch="//" if est else None,
            alpha=0.6 if est else 1.0,
        )
        rect.set_gid(f"{b['index']}|{phase}")
        if dense:
            cause = f" ({b['cause']})" if b["cause"] else ""
            label = f"DENSE {value / scale:.2f} {unit}{cause}"
            if top and value >= 0.45 * top:  # tall bar: the label fits inside it
                ink = "white" if phase == "backward" and not est else "#5c0d08"
                ax.text(
                    x,
                    0.02 * top / scale,
                    label,
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    color=ink,
                    fontweight="bold",
                    clip_on=True,
                )
            else:
                ax.annotate(
                    label,
                    (x, value / scale),
                    xytext=(0, 4),
                    textcoords="offset points",
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    color="#b3261e",
                    fontweight="bold",
                )
            dense_labels.append(f"{layer} {'fwd' if phase == 'forward' else 'bwd'}")
    ax.set_xticks(range(n))
    crowded = sum(len(str(label)) + 1 for label in labels) * 6.5 > 72 * (fig.get_figwidth() - 3)
    ax.set_xticklabels(labels, rotation=35 if crowded else 0, ha="right" if crowded else "center", fontsize=8)
    if pattern is not None:
        ax.set_xlabel(f"layer: {pattern}", fontsize=9)
    for tick, layer in zip(ax.get_xticklabels(), layers):
        if any(by.get((layer, p), {}).get("dense") for p in ("forward", "backward")):
            tick.set_color("#b3261e")
            tick.set_fontweight("bold")
    ax.set_ylabel(f"peak memory added by the layer, max over calls ({unit})")
    ax.set_ylim(0, (top / scale) * 1.45 if top else 1)
    run = rep["run"]
    v = (run["versions"] or [{}])[0]
    n_dense = rep["totals"]["dense_pairs"]
    title = "fusionguard: peak memory per attention layer — " + (
        f"{n_dense} dense layer/phase pair{'s' if n_dense != 1 else ''} (red)" if n_dense else "all fused"
    )
    ax.set_title(title, fontsize=11, loc="left")
    sub = f"torch {v.get('torch', '?')}, ranks {rank_ranges(run['ranks'])}, {fmt_duration(run['duration_s'])}"
    if dense_labels:
        sub += "; dense: " + ", ".join(dense_labels[:8]) + (" ..." if len(dense_labels) > 8 else "")
    fig.text(0.01, 0.01, sub + _left_out(rows), fontsize=7, color="#444444")
    handles = [
        Patch(color=colors[("forward", False)], label="forward, fused"),
        Patch(color=colors[("backward", False)], label="backward, fused"),
        Patch(facecolor=colors[("forward", True)], edgecolor="black", label="forward, DENSE"),
        Patch(facecolor=colors[("backward", True)], edgecolor="black", label="backward, DENSE"),
    ]
    if estimated:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="no memory record: dense score-matrix size"))
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, frameon=False)
    return _finish_plot(fig, ax, rows)
