"""``fusionguard report --html FILE``: the report dict as one self-contained HTML page to open
after a crash: the verdict and how the run ended, the per-layer table, a per-layer memory chart
(inline SVG), the ranks side by side, the first event of each kind on a timeline, the versions.

Only a writer: every number comes from the report dict (``build``, the same as
``--format json``); the chart's from ``chart`` (the same as ``--plot``'s).

Untrusted input: every string from a log goes through ``_t`` (cut to ``MAX_TEXT`` characters,
control characters, DEL, C1, bidirectional overrides and lone surrogates written as ``\\xNN`` /
``\\uNNNN``, then HTML-escaped, quotes included), so a ``<script>`` or ``</style>`` in a layer
name is text. The page has no script at all and says so in its Content-Security-Policy
(``default-src 'none'``): no network, no external script, font or image.

Bounded whatever the log: at most ``_cap(MAX_TABLE_ROWS)`` table rows, ``MAX_CHART_LAYERS`` layers in
the chart, ``_cap(MAX_RANK_COLUMNS)`` ranks side by side, ``_cap(MAX_PROCESSES)`` processes, ``_cap(MAX_CRASHES)``
crash sections, ``_cap(MAX_LIST)`` causes / ranks / files per cell; what is left out is counted on the
page and is in ``--format json``. The page is therefore at most a few MB (``MAX_PAGE_BYTES``,
tested with hostile logs).
"""

from __future__ import annotations

import html
import re
from contextvars import ContextVar
from typing import Any, Dict, List, Optional, Tuple

from fusionguard._version import __version__
from fusionguard.eventlog.formatting import escape, human_bytes
from fusionguard.eventlog.kinds import CAUSES, FIXES
from fusionguard.report import chart
from fusionguard.report.html_style import CSS
from fusionguard.report.plot import short_labels  # (matplotlib itself is imported by plot() only)
from fusionguard.report.render import MAX_CRASHES_SHOWN, fmt_duration, fmt_ts, notice_lines, rank_ranges

MAX_TEXT = 300  # characters of one string from a log in a cell (crash messages: MAX_MESSAGE)
MAX_MESSAGE = 2000
MAX_TABLE_ROWS = 2000
MAX_CHART_LAYERS = chart.MAX_LAYERS
MAX_RANK_COLUMNS = 64
MAX_PROCESSES = 256
MAX_CRASHES = max(16, MAX_CRASHES_SHOWN)
MAX_LIST = 8
MAX_NOTICES = 40  # the banner's finding lines (recompile pressure, no FlexAttention, masks, oom mode)
#: The bound the tests hold the page to, with hostile logs (see docs/cli.md).
MAX_PAGE_BYTES = 16_000_000

_SURROGATE = re.compile("[\ud800-\udfff]")

_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"


#: How much of each list and string the page shows (1.0: the MAX_ figures); render_html lowers it
#: until the written page fits MAX_PAGE_BYTES.
_SCALE: ContextVar[float] = ContextVar("fusionguard_html_scale", default=1.0)
_SCALES = (1.0, 0.25, 0.05, 0.01)


def _cap(n: int) -> int:
    """A MAX_ figure at the page's current scale."""
    return max(1, int(n * _SCALE.get()))


def _t(x: Any, limit: int = MAX_TEXT, scaled: bool = True) -> str:
    """Any value from a log as HTML text: cut (``limit`` at the page's scale, unless not
    ``scaled``), control characters made visible, escaped."""
    if scaled:
        limit = max(20, int(limit * _SCALE.get()))
    s = x if isinstance(x, str) else str(x)
    if len(s) > limit:
        s = s[:limit] + f"… (+{len(s) - limit:,} characters)"
    s = _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", escape(s))
    return html.escape(s, quote=True)


def _lines(x: Any, limit: int = MAX_MESSAGE) -> str:
    """A multi-line log string (a crash message): each line as ``_t``, newlines kept."""
    limit = max(20, int(limit * _SCALE.get()))
    s = x if isinstance(x, str) else str(x)
    cut = len(s) > limit
    body = "\n".join(_t(line, limit, scaled=False) for line in s[:limit].split("\n"))
    return body + (f"\n… (+{len(s) - limit:,} characters)" if cut else "")


def _n(x: Any) -> str:
    """A count: ``1,234``; anything else as text; ``-`` for None."""
    if x is None:
        return "-"
    if isinstance(x, int) and not isinstance(x, bool):
        return f"{x:,}"
    return _t(x)


def _b(x: Any, signed: bool = False) -> str:
    """Bytes: ``2.15 GB``; ``-`` for None."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return _t(human_bytes(x, signed=signed))
    return "-" if x is None else _t(x)


def _attr(x: Any) -> str:
    """A number for a ``data-`` attribute (the tests read them back); empty for None."""
    if isinstance(x, bool) or x is None:
        return ""
    if isinstance(x, (int, float)):
        return repr(x)
    return _t(x)


def _more(shown: int, total: int, what: str) -> str:
    if total <= shown:
        return ""
    return f'<p class="note">+{total - shown:,} more {what} not shown (all in <code>--format json</code>)</p>'


def _rank_text(ranks: List[Any]) -> str:
    return _t(
        rank_ranges(ranks[: _cap(MAX_LIST) * 8])
        + (f" (+{len(ranks) - _cap(MAX_LIST) * 8} more)" if len(ranks) > _cap(MAX_LIST) * 8 else "")
    )


# -- how the run ended -----------------------------------------------------------------------------


def ending(rep: Dict[str, Any]) -> Tuple[str, str]:
    """(kind, sentence): ``crash`` (an uncaught exception), ``native`` (a segfault or abort,
    from the faulthandler file), ``stopped`` (no shutdown event: SIGKILL, the OOM killer, a node
    failure, or still running), ``terminated`` (a shutdown on SIGTERM), ``clean`` (every process
    shut down otherwise), ``unknown``."""
    endings = rep["endings"]
    crashed = [c for c in rep["crashes"] if c["kind"] == "crash" and c.get("crash")]
    native = [c for c in crashed if (c["crash"] or {}).get("where") == "faulthandler"]
    python = [c for c in crashed if c not in native]
    stopped = [e for e in endings if str(e["ending"]).startswith("stopped")]
    if native:
        ev = native[0]["crash"]
        return "native", f"native crash: {ev.get('exc_type')} on {_who(native[0])}" + _others(len(native))
    if any(e["ending"] == "crash" for e in endings) and python:
        ev = python[0]["crash"]
        first = str(ev.get("message") or "").split("\n")[0]
        return "crash", f"crash with {ev.get('exc_type')}: {first} on {_who(python[0])}" + _others(len(python))
    if stopped:
        ranks = rank_ranges([e["rank"] for e in stopped])
        return (
            "stopped",
            f"stopped without shutdown (rank {ranks}): SIGKILL and the OOM killer leave the same log; or a node failure, or still running",
        )
    real = [e for e in endings if e["ending"] != "summary only"]
    signalled = [e for e in real if str(e["ending"]).startswith("sigterm")]
    if signalled:  # a shutdown, but not the end of the program: a scheduler's time limit, a preemption, kill
        ranks = rank_ranges([e["rank"] for e in signalled])
        return (
            "terminated",
            f"terminated by SIGTERM (rank {ranks}): the program did not finish on its own (a time limit, a preemption, kill)",
        )
    if real:
        reasons = sorted({str(e["ending"]) for e in real})
        thread = any("thread crash" in r for r in reasons)
        return "clean", "clean: every process shut down (" + ", ".join(reasons) + ")" + (
            "; a thread other than the main one crashed" if thread else ""
        )
    return "unknown", "how the run ended is unknown (only summary rows gathered from other ranks)"


def _who(c: Dict[str, Any]) -> str:
    host = f" on {c['host']}" if c.get("host") else ""
    return f"rank {c.get('rank')} (pid {c.get('pid')}{host})"


def _others(n: int) -> str:
    return f" (+{n - 1} more process{'es' if n > 2 else ''})" if n > 1 else ""


# -- sections --------------------------------------------------------------------------------------


def _count(n: int, what: str) -> str:
    return f"{n:,} {what}{'' if n == 1 else 's'}"


def _banner(rep: Dict[str, Any]) -> str:
    totals = rep["totals"]
    kind, sentence = ending(rep)
    if not rep["rows"]:
        verdict, css = "No FlexAttention calls or compiles in the input", "b-none"
    elif totals["dense_calls"]:
        blocked = f" ({totals['blocked_calls']:,} blocked)" if totals["blocked_calls"] else ""
        big = f"; largest score matrix {human_bytes(totals['scores_bytes_max'])}" if totals["scores_bytes_max"] else ""
        verdict = (
            f"DENSE: {totals['dense_calls']:,} dense FlexAttention call{'s' if totals['dense_calls'] != 1 else ''}{blocked} "
            f"in {totals['dense_pairs']} layer/phase pair{'s' if totals['dense_pairs'] != 1 else ''}{big}"
        )
        css = "b-dense"
    else:
        verdict, css = "OK: no dense FlexAttention", "b-ok"
    if kind in ("crash", "native"):
        css = "b-crash"
    elif kind in ("stopped", "terminated") and css == "b-ok":
        css = "b-stopped"
    also = f"{_count(totals['fused_calls'], 'fused call')}, {_count(totals['compiles'], 'compiled graph')}"
    if totals["allowed_dense_calls"]:
        also += f", {_count(totals['allowed_dense_calls'], 'allowed dense call')} (allow_dense(): on purpose)"
    if totals["causes"]:
        causes = list(totals["causes"].items())
        also += (
            "; causes: " + ", ".join(f"{k} ×{v:,}" for k, v in causes[: _cap(MAX_LIST)]) + (" …" if len(causes) > _cap(MAX_LIST) else "")
        )
    notices = notice_lines(rep)  # the text report's own lines: one wording, one counting path
    shown = "".join(f'<p class="notice">{_t(line, MAX_TEXT * 3)}</p>' for line in notices[: _cap(MAX_NOTICES)])
    return (
        f'<header class="banner {css}" id="verdict" data-ending="{kind}">'
        f"<h1>{_t(verdict, len(verdict), scaled=False)}</h1>"  # numbers and fixed words: never cut
        f'<p id="ending"><b>Run ended:</b> {_t(sentence, MAX_TEXT * 2)}</p>'
        f"<p>{_t(also, MAX_TEXT * 3)}</p>"
        + (f'<div id="notices">{shown}{_more(_cap(MAX_NOTICES), len(notices), "lines")}</div>' if notices else "")
        + "</header>"
    )


def _fixes() -> Dict[str, Tuple[str, str]]:
    """cause -> (what it means, the fix): the words the guard's own messages use."""
    return {k: (CAUSES.get(k, ""), FIXES.get(k, "")) for k in CAUSES}


_COLUMNS = ("dense", "allowed", "blocked", "fused", "compiles", "inlined")


def _layer_table(rep: Dict[str, Any]) -> str:
    rows = rep["rows"]
    if not rows:
        return "<h2>Layers</h2><p>No FlexAttention calls or compiles in the input.</p>"
    fixes = _fixes()
    multi = bool(rep["ranks"])
    head = (
        "<tr><th>layer</th><th>phase</th><th>dense</th><th>allowed</th><th>blocked</th><th>fused</th><th>compiled</th>"
        "<th>inlined</th><th>causes</th><th>peak Δ med / max</th><th>alloc Δ med / max</th><th>dense scores max</th>"
        "<th>first dense call site</th>" + ("<th>dense ranks</th>" if multi else "") + "</tr>"
    )
    out = [
        "<h2>Layers</h2>",
        '<p class="note">dense: calls that ran (or were blocked) dense; fused: calls executed fused; compiled: graphs compiled or loaded; '
        "inlined: dense implementations Dynamo traced into a graph. "
        "Memory: the layer's own peak / allocation rise per call (median / max).</p>",
        f'<div class="scroll"><table id="layers" data-rows="{len(rows)}"><thead>{head}</thead><tbody>',
    ]
    for r in rows[: _cap(MAX_TABLE_ROWS)]:
        cls = ' class="row dense"' if r["dense"] else ' class="row"'
        cells = [f'<td class="layer">{_t(r["layer"])}</td><td class="phase">{_t(r["phase"])}</td>']
        for col in _COLUMNS:
            dense = " dense" if col == "dense" and r[col] else ""
            cells.append(f'<td class="n{dense}" data-col="{col}" data-value="{_attr(r[col])}">{_n(r[col])}</td>')
        causes = list(r["causes"].items())
        parts = []
        for k, v in causes[: _cap(MAX_LIST)]:
            meaning, fix = fixes.get(k, ("", ""))
            tip = f' title="{_t(meaning + ". Fix: " + fix, 1000)}"' if fix else ""
            parts.append(f"<span{tip}><b>{_t(k)}</b> ×{_n(v)}</span>")
        more = f" +{len(causes) - _cap(MAX_LIST)} more" if len(causes) > _cap(MAX_LIST) else ""
        cells.append(f'<td class="causes">{"<br>".join(parts) or "-"}{more}</td>')
        for med, mx in (("peak_delta_median", "peak_delta_max"), ("alloc_delta_median", "alloc_delta_max")):
            cells.append(
                f'<td class="n" data-col="{mx}" data-value="{_attr(r[mx])}" data-median="{_attr(r[med])}">'
                + ("-" if r[med] is None and r[mx] is None else f"{_b(r[med], True)} / {_b(r[mx], True)}")
                + "</td>"
            )
        cells.append(
            f'<td class="n" data-col="scores_bytes_max" data-value="{_attr(r["scores_bytes_max"])}">{_b(r["scores_bytes_max"])}</td>'
        )
        cells.append(f"<td><code>{_t(r['first_dense_call_site']) if r['first_dense_call_site'] else '-'}</code></td>")
        if multi:
            cells.append(f"<td>{_rank_text(r['dense_ranks']) if r['dense_ranks'] else '-'}</td>")
        out.append(f'<tr{cls} data-layer="{_t(r["layer"])}" data-phase="{_t(r["phase"])}">' + "".join(cells) + "</tr>")
    out.append("</tbody></table></div>")
    out.append(_more(_cap(MAX_TABLE_ROWS), len(rows), "layer/phase rows"))
    present = [k for k in rep["totals"]["causes"] if k in fixes][: _cap(MAX_LIST) * 2]
    if present:
        out.append('<h3>Causes and their fixes</h3><dl class="kv" id="fixes">')
        for k in present:
            meaning, fix = fixes[k]
            out.append(f"<dt><b>{_t(k)}</b></dt><dd>{_t(meaning, 1000)}.<br><b>Fix:</b> {_t(fix, 1000)}</dd>")
        out.append("</dl>")
    return "".join(out)


def _svg_text(x: float, y: float, text: str, extra: str = "") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}"{extra}>{text}</text>'


def _chart(rep: Dict[str, Any]) -> str:
    """The per-layer chart as inline SVG; each bar carries its numbers (``data-bytes`` or
    ``data-calls``, layer index and phase) and a tooltip."""
    rows = rep["rows"]
    all_layers = chart.layers(rows)
    names = chart.shown(rows)
    if not names:
        return ""
    memory = chart.kind(rep) == "memory"
    bars = chart.memory_bars(rep) if memory else chart.count_bars(rep)
    labels, pattern = short_labels(names)
    slot = 44 if memory else 56
    longest = max((len(str(label)) for label in labels), default=1)
    left, top_pad, plot_h, bottom = 70, 16, 240, 24 + 5 * min(40, longest)
    width = max(360, left + 20 + slot * len(names))
    height = top_pad + plot_h + bottom
    top = max((b["value"] for b in bars), default=0)
    if memory:
        unit, scale = chart.unit(top)
    else:
        unit, scale = "calls", 1.0
    ymax = (top / scale) * 1.1 if top else 1.0
    y0 = top_pad + plot_h

    def y(v: float) -> float:
        return y0 - (v / scale) / ymax * plot_h

    svg = [
        f'<svg id="chart" data-kind="{"memory" if memory else "counts"}" xmlns="http://www.w3.org/2000/svg" '
        f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">'
    ]
    for i in range(5):  # the y grid and its labels
        v = ymax * i / 4
        yy = y0 - plot_h * i / 4
        svg.append(f'<line x1="{left}" y1="{yy:.1f}" x2="{width - 10}" y2="{yy:.1f}" stroke="#e5e5e5"/>')
        label = f"{v:.2f} {unit}" if memory else f"{v:,.0f}"
        svg.append(_svg_text(left - 6, yy + 4, label, ' text-anchor="end"'))
    colors = {("forward", False): "#7fa7d6", ("backward", False): "#2c5d94", ("forward", True): "#f08a7e", ("backward", True): "#b3261e"}
    for b in bars:
        if memory:
            j = chart.PHASES.index(b["phase"])
            w = slot * 0.38
            x = left + 10 + b["index"] * slot + slot / 2 + (j - 1) * w
            dense = b["dense"]
            fill = colors[(b["phase"], dense)]
            value_text = human_bytes(b["value"])
            tip = (
                f"{b['layer']} {b['phase']}: {'DENSE ' if dense else ''}{value_text}"
                + (f" ({b['cause']})" if b["cause"] else "")
                + (" - no memory record: the dense score-matrix size" if b["estimated"] else "")
            )
            attrs = f'data-bytes="{_attr(b["value"])}" data-estimated="{str(b["estimated"]).lower()}" data-dense="{str(dense).lower()}"'
            style = ' stroke="#000" stroke-width="1"' if dense else ""
            style += ' fill-opacity="0.55" stroke-dasharray="3 2"' if b["estimated"] else ""
        else:
            j = (chart.PHASES.index(b["phase"])) * 2 + (1 if b["what"] == "dense" else 0)
            w = slot * 0.2
            x = left + 10 + b["index"] * slot + slot / 2 + (j - 2) * w
            fill = colors[(b["phase"], b["what"] == "dense")]
            tip = f"{b['layer']} {b['phase']}: {b['value']:,} {b['what']} calls"
            attrs = f'data-calls="{_attr(b["value"])}" data-what="{b["what"]}"'
            style = ""
        yy = y(b["value"])
        svg.append(
            f'<rect class="bar" data-index="{b["index"]}" data-phase="{b["phase"]}" {attrs} x="{x:.1f}" y="{yy:.1f}" '
            f'width="{w:.1f}" height="{max(0.0, y0 - yy):.1f}" fill="{fill}"{style}><title>{_t(tip)}</title></rect>'
        )
        if memory and b["dense"]:
            svg.append(_svg_text(x + w / 2, yy - 3, "D", ' text-anchor="middle" class="dense-label"'))
    svg.append(f'<line x1="{left}" y1="{y0}" x2="{width - 10}" y2="{y0}" stroke="#999"/>')
    dense_layers = {r["layer"] for r in rows if r["dense"]}
    for i, label in enumerate(labels):
        x = left + 10 + i * slot + slot / 2
        cls = ' class="dense-label"' if names[i] in dense_layers else ""
        svg.append(
            f'<text x="{x:.1f}" y="{y0 + 12}" text-anchor="end" transform="rotate(-40 {x:.1f} {y0 + 12})"{cls}>'
            f"{_t(chart.label(label))}</text>"
        )
    svg.append("</svg>")
    what = (
        "peak memory the layer added per call, max over calls; red, outlined: dense (D); "
        "dashed: no memory record, the dense score-matrix size"
        if memory
        else "no memory figures in the log (CPU run or watch(memory=False)): "
        "FlexAttention calls per layer (light: forward, dark: backward; red: dense)"
    )
    legend = (
        '<p class="note">'
        + _t(what, 400)
        + (f"; layer: <code>{_t(pattern)}</code>" if pattern else "")
        + "; forward left, backward right.</p>"
    )
    return (
        "<h2>Memory per layer</h2>"
        + legend
        + '<div class="scroll">'
        + "".join(svg)
        + "</div>"
        + _more(MAX_CHART_LAYERS, len(all_layers), "layers")
    )


def _ranks(rep: Dict[str, Any]) -> str:
    endings = rep["endings"]
    out = ["<h2>Ranks and processes</h2>"]
    if rep["ranks"]:
        ranks = [rr["rank"] for rr in rep["ranks"]][: _cap(MAX_RANK_COLUMNS)]
        per: Dict[Any, Dict[Tuple[str, str], int]] = {}
        for rr in rep["ranks"][: _cap(MAX_RANK_COLUMNS)]:
            per[rr["rank"]] = {(d["layer"], d["phase"]): d["dense"] for d in rr["dense"]}
        ended: Dict[Any, List[str]] = {}
        for e in endings:
            ended.setdefault(e["rank"], []).append(str(e["ending"]))
        head = "<tr><th>layer</th><th>phase</th>" + "".join(f"<th>rank {_t(r)}</th>" for r in ranks) + "</tr>"
        body = ['<tr class="ended"><td colspan="2"><b>ended</b></td>']
        for r in ranks:
            what = ", ".join(sorted(set(ended.get(r, ["-"]))))
            bad = any(w == "crash" or w.startswith("stopped") for w in ended.get(r, []))
            body.append(f'<td{" class=dense" if bad else ""}>{_t(what)}</td>')
        body.append("</tr><tr><td colspan=\"2\"><b>dense calls</b></td>")
        for rr in rep["ranks"][: _cap(MAX_RANK_COLUMNS)]:
            body.append(f'<td class="n{" dense" if rr["dense_calls"] else ""}">{_n(rr["dense_calls"])}</td>')
        body.append("</tr>")
        for row in rep["rows"][: _cap(MAX_TABLE_ROWS)]:
            key = (row["layer"], row["phase"])
            fused = set(map(str, row["fused_ranks"]))
            cells = []
            for r in ranks:
                d = per.get(r, {}).get(key, 0)
                if d:
                    cells.append(f'<td class="n dense">{_n(d)} dense</td>')
                else:
                    cells.append(f'<td class="n">{"fused" if str(r) in fused else "-"}</td>')
            body.append(f"<tr><td>{_t(row['layer'])}</td><td>{_t(row['phase'])}</td>{''.join(cells)}</tr>")
        out.append(f'<div class="scroll"><table id="ranks">{head}{"".join(body)}</table></div>')
        out.append(_more(_cap(MAX_RANK_COLUMNS), len(rep["ranks"]), "ranks"))
        if rep["disagreements"]:
            out.append("<p><b>Ranks disagree:</b></p><ul>")
            for d in rep["disagreements"][: _cap(MAX_TABLE_ROWS)]:
                out.append(
                    f"<li>{_t(d['layer'])} {_t(d['phase'])}: dense on rank {_rank_text(d['dense_ranks'])}, "
                    f"fused on rank {_rank_text(d['fused_ranks'])}</li>"
                )
            out.append("</ul>")
        else:
            out.append("<p>Ranks agree on every layer/phase.</p>")
    rows = []
    for e in endings[: _cap(MAX_PROCESSES)]:
        bad = e["ending"] == "crash" or str(e["ending"]).startswith("stopped")
        files = e.get("files") or []
        rows.append(
            f"<tr><td>{_t(e['rank'])}</td><td>{_t(e['host'])}</td><td>{_t(e['pid'])}</td>"
            f'<td{" class=dense" if bad else ""}>{_t(e["ending"])}</td><td class="n">{_n(e["events"])}</td>'
            f"<td>{_t(fmt_ts(_num(e['first_ts'])))}</td><td>{_t(fmt_ts(_num(e['last_ts'])))}</td><td class=\"n\">{_n(e['crashes'])}</td>"
            f"<td>{'<br>'.join(_t(f) for f in files[: _cap(MAX_LIST)])}{' …' if len(files) > _cap(MAX_LIST) else ''}</td></tr>"
        )
    out.append(
        '<div class="scroll"><table id="processes"><tr><th>rank</th><th>host</th><th>pid</th><th>ended</th><th>events</th>'
        "<th>first event</th><th>last event</th><th>crashes</th><th>files</th></tr>" + "".join(rows) + "</table></div>"
    )
    out.append(_more(_cap(MAX_PROCESSES), len(endings), "processes"))
    return "".join(out)


def _num(x: Any) -> Optional[float]:
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _event_cells(e: Dict[str, Any], t0: Optional[float]) -> str:
    ts = _num(e.get("ts"))
    rel = f"{ts - t0:+.3f} s" if ts is not None and t0 is not None else "-"
    where = " ".join(_t(x) for x in (e.get("layer"), e.get("phase")) if x is not None)
    detail = []
    for k in ("path", "cause", "action", "template", "source", "reason", "exc_type", "where", "error", "function", "count"):
        if e.get(k) is not None:
            detail.append(f"{k}={_t(e[k])}")
    if _num(e.get("scores_bytes")) is not None:
        detail.append(f"scores={_b(e['scores_bytes'])}")
    for k in ("alloc_delta", "peak_delta"):
        if _num(e.get(k)) is not None:
            detail.append(f"{k.split('_')[0]}={_b(e[k], True)}")
    return (
        f"<td class=\"n\">{rel}</td><td>{_n(e.get('seq'))}</td><td><b>{_t(e.get('event'))}</b></td>"
        f"<td>{where}</td><td>{' '.join(detail)}</td>"
    )


def _crashes(rep: Dict[str, Any]) -> str:
    crashes = rep["crashes"]
    if not crashes:
        return ""
    out = ["<h2>Crashes and stops</h2>"]
    for c in crashes[: _cap(MAX_CRASHES)]:
        if c["kind"] == "crash":
            ev = c.get("crash") or {}
            native = ev.get("where") == "faulthandler"
            out.append(
                f'<section class="crash"><h3>{"NATIVE CRASH" if native else "CRASH"} {_t(_who(c))} at {_t(fmt_ts(_num(ev.get("ts"))))}</h3>'
            )
            out.append(f"<pre>{_t(ev.get('exc_type'))}: {_lines(ev.get('message') or '')}</pre>")
            if ev.get("diagnosis"):
                out.append(f"<p><b>diagnosis:</b> {_t(ev['diagnosis'], 1000)}</p>")
            lf = ev.get("last_flex")
            if isinstance(lf, dict):
                out.append(
                    f"<p><b>last FlexAttention event:</b> {_t(lf.get('event'))} {_t(lf.get('path'))} {_t(lf.get('phase'))} "
                    f"of {_t(lf.get('layer') or '(no layer)')}"
                    + (f", cause {_t(lf['cause'])}" if lf.get("cause") else "")
                    + (f", scores {_b(lf['scores_bytes'])}" if _num(lf.get("scores_bytes")) is not None else "")
                    + "</p>"
                )
            cuda = ev.get("cuda")
            if isinstance(cuda, dict):
                out.append(
                    f"<p><b>CUDA memory:</b> allocated {_b(cuda.get('allocated'))}, reserved {_b(cuda.get('reserved'))}, "
                    f"peak {_b(cuda.get('peak'))}</p>"
                )
            frames = ev.get("frames")
            if isinstance(frames, list) and frames:
                out.append("<pre>" + "\n".join(_t(f) for f in frames[-8:]) + "</pre>")
            t0 = _num(ev.get("ts"))
            label = "before the crash (time relative to it)"
        else:
            last = c["last_events"][-1] if c["last_events"] else {}
            out.append(
                f'<section class="crash"><h3>STOPPED {_t(_who(c))}: the log ends at {_t(fmt_ts(_num(last.get("ts"))))} '
                "without a shutdown event</h3>"
            )
            if c.get("forked_from") is not None:
                out.append(f"<p>forked from pid {_t(c['forked_from'])}: a worker that ended with os._exit, or was killed.</p>")
            else:
                out.append(
                    "<p>Killed (SIGKILL and the OOM killer leave the same log), a node failure, or the process is still running.</p>"
                )
            t0 = _num(last.get("ts"))
            label = "last events (time relative to the last one)"
        if c["last_events"]:
            out.append(f"<p class=\"note\">{label}</p><table><tr><th>time</th><th>seq</th><th>event</th><th>layer</th><th>detail</th></tr>")
            for e in c["last_events"][-50:]:
                out.append("<tr>" + _event_cells(e, t0) + "</tr>")
            out.append("</table>")
        out.append("</section>")
    out.append(_more(_cap(MAX_CRASHES), len(crashes), "crash/stop sections"))
    return "".join(out)


def _timeline(rep: Dict[str, Any]) -> str:
    firsts = rep.get("first_events") or []
    if not firsts:
        return ""
    t0 = _num(rep["run"]["first_ts"])
    t1 = _num(rep["run"]["last_ts"])
    span = (t1 - t0) if t0 is not None and t1 is not None and t1 > t0 else 0.0
    width, left, row_h = 900, 160, 18
    shown = firsts[:64]
    height = 24 + row_h * len(shown)
    svg = [f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}">']
    svg.append(f'<line x1="{left}" y1="12" x2="{width - 20}" y2="12" stroke="#999"/>')
    svg.append(_svg_text(left, 9, "0 s") + _svg_text(width - 20, 9, _t(fmt_duration(span)), ' text-anchor="end"'))
    for i, e in enumerate(shown):
        ts = _num(e.get("ts"))
        x = left + ((ts - t0) / span * (width - 20 - left) if ts is not None and t0 is not None and span else 0)
        yy = 24 + row_h * i
        bad = e.get("event") in ("crash", "internal_error") or (e.get("event") == "flex_call" and e.get("path") == "dense")
        color = "#b3261e" if bad else "#2c5d94"
        svg.append(_svg_text(left - 8, yy + 4, _t(e.get("event"), 40), ' text-anchor="end"'))
        svg.append(f'<line x1="{left}" y1="{yy}" x2="{width - 20}" y2="{yy}" stroke="#f0f0f0"/>')
        tip = f"{e.get('event')} at {fmt_ts(ts)} (rank {e.get('rank')})"
        svg.append(f'<circle cx="{x:.1f}" cy="{yy}" r="5" fill="{color}"><title>{_t(tip)}</title></circle>')
    svg.append("</svg>")
    rows = "".join(f"<tr>{_event_cells(e, t0)}<td>{_t(e.get('rank'))}</td></tr>" for e in shown)
    head = "".join(f"<th>{h}</th>" for h in ("time (from the first event)", "seq", "event", "layer", "detail", "rank"))
    return (
        "<h2>Timeline: the first event of each kind</h2>"
        + '<div class="scroll">'
        + "".join(svg)
        + "</div>"
        + f'<table id="first-events"><tr>{head}</tr>'
        + rows
        + "</table>"
    )


def _run(rep: Dict[str, Any]) -> str:
    run = rep["run"]
    out = ["<h2>Run and versions</h2>", '<dl class="kv" id="run">']
    out.append(f"<dt>files</dt><dd>{_n(run['files'])}</dd><dt>processes</dt><dd>{_n(run['processes'])}</dd>")
    out.append(
        f"<dt>ranks</dt><dd>{_rank_text(run['ranks'])}"
        + (f" of world size {_n(run['world_size'])}" if run.get("world_size") else "")
        + "</dd>"
    )
    out.append(
        f"<dt>hosts</dt><dd>{', '.join(_t(h) for h in run['hosts'][: _cap(MAX_LIST)])}"
        f"{' …' if len(run['hosts']) > _cap(MAX_LIST) else ''}</dd>"
    )
    out.append(
        f"<dt>time</dt><dd>{_t(fmt_ts(_num(run['first_ts'])))} → {_t(fmt_ts(_num(run['last_ts'])))} "
        f"({_t(fmt_duration(_num(run['duration_s'])))})</dd>"
    )
    out.append(
        f"<dt>events</dt><dd>{_n(run['events'])}: "
        + ", ".join(f"{_t(k)} {_n(v)}" for k, v in list(run["event_kinds"].items())[:40])
        + "</dd>"
    )
    for v in run["versions"][: _cap(MAX_LIST)]:
        out.append(
            f"<dt>versions</dt><dd>fusionguard {_t(v['fusionguard'])}, torch {_t(v['torch'])}, triton {_t(v['triton'] or '-')}, "
            f"python {_t(v['python'])}" + (f" ({_n(v['processes'])} processes)" if len(run["versions"]) > 1 else "") + "</dd>"
        )
    for host, names in list(run["devices"].items())[: _cap(MAX_LIST)]:
        counts: Dict[str, int] = {}
        for n in names:
            counts[str(n)] = counts.get(str(n), 0) + 1
        out.append(
            f"<dt>devices</dt><dd>{_t(host)}: "
            + ", ".join(f"{v}× {_t(k)}" if v > 1 else _t(k) for k, v in list(counts.items())[: _cap(MAX_LIST)])
            + "</dd>"
        )
    if run["schemas"]:
        out.append("<dt>schema</dt><dd>" + ", ".join(_t(k) for k in list(run["schemas"])[: _cap(MAX_LIST)]) + "</dd>")
    out.append("</dl>")
    if rep["warnings"]:
        out.append('<h3>Warnings about the input</h3><ul id="warnings">')
        out += [f"<li>{_t(w, 1000)}</li>" for w in rep["warnings"][:50]]
        out.append("</ul>")
    return "".join(out)


def render_html(rep: Dict[str, Any]) -> str:
    """The report dict as one self-contained HTML page (no script, no network), at most
    ``MAX_PAGE_BYTES`` bytes of UTF-8 as written: measured, and rendered again showing less (fewer
    rows, shorter strings, said on the page) until it fits; the verdict is never cut."""
    for scale in _SCALES:
        token = _SCALE.set(scale)
        try:
            page = _page(rep, scale)
        finally:
            _SCALE.reset(token)
        if len(page.encode("utf-8")) <= MAX_PAGE_BYTES:
            return page
    token = _SCALE.set(_SCALES[-1])
    try:
        return _page(rep, 0.0)  # only the verdict and what was cut
    finally:
        _SCALE.reset(token)


def _cut_note(scale: float) -> str:
    if scale >= 1.0:
        return ""
    what = (
        f"at most {_cap(MAX_TABLE_ROWS):,} layer/phase rows, {_cap(MAX_PROCESSES):,} processes, "
        f"{_cap(MAX_RANK_COLUMNS):,} ranks side by side, "
        f"{_cap(MAX_CRASHES):,} crash sections and strings of {max(20, int(MAX_TEXT * scale)):,} characters"
        if scale
        else "only the verdict: every section was left out"
    )
    return (
        f'<p class="note" id="cut"><b>This page was cut to stay within {MAX_PAGE_BYTES:,} bytes</b> (the log holds more than a page can): '
        f"{what}. Everything is in <code>fusionguard report --format json</code>.</p>"
    )


def _page(rep: Dict[str, Any], scale: float) -> str:
    """The page at the current ``_SCALE``; ``scale`` 0: the verdict and the cut note only."""
    run = rep["run"]
    title = f"fusionguard report: {run['files']} file(s), {run['processes']} process(es)"
    sections = [_layer_table(rep), _chart(rep), _ranks(rep), _crashes(rep), _timeline(rep), _run(rep)] if scale else []
    body = [
        _banner(rep),
        "<main>",
        _cut_note(scale),
        *sections,
        f'<p class="note">Written by fusionguard {_t(__version__)} <code>report --html</code>; the same numbers as '
        "<code>fusionguard report --format json</code>. Every string from the logs is shown as text.</p>",
        "</main>",
    ]
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_t(title)}</title><style>{CSS}</style></head><body>" + "".join(body) + "</body></html>\n"
    )
