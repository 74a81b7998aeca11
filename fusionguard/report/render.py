"""Writing the report dict for people and programs: text (a terminal), CSV (one row per
layer and phase), JSON (the dict itself).

A log's strings are untrusted: text and CSV escape every control character (``eventlog.formatting.escape``),
JSON writes C1 controls and bidirectional overrides as ``\\uXXXX``; none of them can drive the
terminal that shows the report.
"""

from __future__ import annotations

import csv
import io
import json
import re
import time
from typing import Any, Dict, Iterable, List, Optional, Tuple

from fusionguard.eventlog.formatting import UNSAFE_ABOVE_C0, causes_text, escape, human_bytes, mem_text, site_text, table
from fusionguard.report.aggregate import NO_LAYER

MAX_CRASHES_SHOWN = 4  # crash/stop sections in the text report (all in --format json)
DEVICES_WIDTH = 120  # a longer per-host devices line (hundreds of hosts) is summarised by device kind
MAX_DEVICE_KINDS = 6  # device kinds named in that summary


def rank_ranges(ranks: Iterable[Any]) -> str:
    """``0-3,5``: ranks as ranges (non-integer ranks after them); ``-`` for none."""
    ints = sorted({r for r in ranks if isinstance(r, int)})
    others = sorted({str(r) for r in ranks if not isinstance(r, int)})
    parts: List[str] = []
    i = 0
    while i < len(ints):
        j = i
        while j + 1 < len(ints) and ints[j + 1] == ints[j] + 1:
            j += 1
        parts.append(str(ints[i]) if i == j else f"{ints[i]}-{ints[j]}")
        i = j + 1
    return ",".join(parts + others) or "-"


def fmt_ts(ts: Optional[float]) -> str:
    """A Unix time as UTC to the millisecond; ``-`` when unknown."""
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) + f".{int((ts % 1) * 1000):03d} UTC"


def fmt_duration(seconds: Optional[float]) -> str:
    """``12.3s``, ``4m05s``, ``1h02m03s``; ``-`` when unknown."""
    if seconds is None:
        return "-"
    s = int(round(seconds))
    if seconds < 60:
        return f"{seconds:.1f}s"
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _event_line(e: Dict[str, Any], t0: Optional[float]) -> str:
    ts = e.get("ts")
    rel = f"{ts - t0:+9.3f}s" if isinstance(ts, (int, float)) and t0 is not None else " " * 10
    parts = [rel, f"seq {e.get('seq', '?'):>6}" if e.get("seq") is not None else "seq      ?", str(e.get("event"))]
    if e.get("layer") is not None or e.get("phase") is not None:
        parts.append(f"{e.get('layer') or NO_LAYER} {e.get('phase') or ''}".rstrip())
    for k in ("path", "cause", "action", "template", "reason", "exc_type", "where", "error", "function", "count"):
        if e.get(k) is not None:
            parts.append(f"{k}={e[k]}")
    if e.get("scores_bytes") is not None:
        parts.append(f"scores={human_bytes(e['scores_bytes'])}")
    for k in ("alloc_delta", "peak_delta"):
        if e.get(k) is not None:
            parts.append(f"{k.split('_')[0]}={human_bytes(e[k], signed=True)}")
    if e.get("thread") not in (None, "MainThread"):
        parts.append(f"thread={e['thread']}")
    return "  ".join(parts)


def _who(item: Dict[str, Any]) -> str:
    host = f" on {item['host']}" if item.get("host") else ""
    return f"rank {item.get('rank')} (pid {item.get('pid')}{host})"


_ESCAPED_NEWLINE = escape("\n")  # a crash message's first line is what comes before it


def escaped(obj: Any) -> Any:
    """``obj`` (the report dict or any part of it) with every string and key escaped."""
    if isinstance(obj, str):
        return escape(obj)
    if isinstance(obj, dict):
        return {(escape(k) if isinstance(k, str) else k): escaped(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [escaped(x) for x in obj]
    return obj


def render_text(rep: Dict[str, Any]) -> str:
    """The report for people. Every string from a log is escaped first: control characters
    (ESC, newlines) are shown as ``\\x1b``, never sent to the terminal."""
    rep = escaped(rep)
    run, totals = rep["run"], rep["totals"]
    out: List[str] = []
    ranks = run["ranks"]
    out.append(
        f"fusionguard report: {run['files']} file{'s' if run['files'] != 1 else ''}, "
        f"{run['processes']} process{'es' if run['processes'] != 1 else ''}, "
        f"rank{'s' if len(ranks) != 1 else ''} {rank_ranges(ranks)}"
        + (f" of world size {run['world_size']}" if run.get("world_size") and run["world_size"] > 1 else "")
        + f", {run['events']:,} events"
    )
    for v in run["versions"]:
        out.append(
            f"  versions: fusionguard {v['fusionguard']}, torch {v['torch']}, triton {v['triton'] or '-'}, python {v['python']}"
            + (f"  ({v['processes']} processes)" if len(run["versions"]) > 1 else "")
        )
    if run["devices"]:
        out.append("  devices:  " + devices_line(run["devices"]))
    out.append(f"  time:     {fmt_ts(run['first_ts'])} -> {fmt_ts(run['last_ts'])} ({fmt_duration(run['duration_s'])})")
    if run["schemas"]:
        out.append("  schema:   " + ", ".join(f"{k}" for k in sorted(run["schemas"])))
    endings: Dict[str, List[str]] = {}
    for e in rep["endings"]:
        endings.setdefault(e["ending"], []).append(str(e["rank"]))
    out.append(
        "  ended:    "
        + "; ".join(
            f"{k} (rank {','.join(v) if len(v) < 9 else rank_ranges([int(x) if x.isdigit() else x for x in v])})"
            for k, v in sorted(endings.items())
        )
        if endings
        else "  ended:    -"
    )
    for w in rep["warnings"]:
        out.append(f"  warning:  {w}")
    out.append("")

    early = early_lines(rep)
    if early:
        out.extend(early + [""])

    allowed = totals["allowed_dense_calls"]
    allowed_text = (
        f"{allowed:,} allowed dense call{'s' if allowed != 1 else ''} (allow_dense() or the debug flag: on purpose, not counted as dense)"
        if allowed
        else ""
    )
    masks = rep.get("masks") or {}
    if masks.get("dense") or masks.get("small") or masks.get("compiled"):
        out.append(masks_text(masks))
    if not rep["rows"]:
        out.append("No FlexAttention calls or compiles in the input.")
    else:
        fused = f"{totals['fused_calls']:,} fused call{'s' if totals['fused_calls'] != 1 else ''}"
        graphs = f"{totals['compiles']:,} compiled graph{'s' if totals['compiles'] != 1 else ''}"
        if totals["dense_calls"]:
            big = f"; largest dense score matrix {human_bytes(totals['scores_bytes_max'])} (fp32)" if totals["scores_bytes_max"] else ""
            blocked = f" ({totals['blocked_calls']:,} blocked)" if totals["blocked_calls"] else ""
            out.append(
                f"DENSE: {totals['dense_calls']:,} dense FlexAttention call{'s' if totals['dense_calls'] != 1 else ''}{blocked} in "
                f"{totals['dense_pairs']} layer/phase pair{'s' if totals['dense_pairs'] != 1 else ''}; "
                f"causes: {causes_text(totals['causes'])}{big}"
            )
            if totals.get("oom_blocked_calls"):
                out.append(oom_line(rep))
            out.append(f"  also: {fused}, {graphs}" + (f"; {allowed_text}" if allowed else ""))
        else:
            out.append(f"OK: no dense FlexAttention; {fused}, {graphs}")
            if allowed:
                out.append(f"  also: {allowed_text}")
        out.append("")
        show_allowed = bool(allowed)
        table_rows = []
        for r in rep["rows"]:
            cells = [r["layer"], r["phase"], f"{r['dense']:,}"]
            if show_allowed:
                cells.append(f"{r['allowed']:,}")
            cells += [
                f"{r['fused']:,}",
                f"{r['compiles']:,}",
                causes_text(r["causes"]),
                mem_text(r["alloc_delta_median"], r["alloc_delta_max"]),
                mem_text(r["peak_delta_median"], r["peak_delta_max"]),
                r["first_dense_call_site"] or "-",
            ]
            table_rows.append(cells)
        heads = (
            ["layer", "phase", "dense"]
            + (["allowed"] if show_allowed else [])
            + [
                "fused",
                "compiled",
                "causes",
                "alloc Δ med / max",
                "peak Δ med / max",
                "first dense call site",
            ]
        )
        n = 4 if show_allowed else 3
        out.extend(table(heads, table_rows, right=range(2, n + 2)))
        out.append("")
        out.append("dense: calls that ran (or were blocked) dense; fused: calls executed fused; compiled: graphs compiled or loaded")

    if rep["ranks"]:
        out.append("")
        out.append("Ranks:")
        for rr in rep["ranks"]:
            if rr["dense"]:
                where = ", ".join(f"{d['layer']} {d['phase']} ×{d['dense']}" for d in rr["dense"][:6])
                more = f", +{len(rr['dense']) - 6} more" if len(rr["dense"]) > 6 else ""
                out.append(f"  rank {rr['rank']}: {rr['dense_calls']:,} dense: {where}{more}")
            else:
                out.append(f"  rank {rr['rank']}: no dense")
        if rep["disagreements"]:
            out.append("  ranks disagree:")
            for d in rep["disagreements"]:
                out.append(
                    f"    {d['layer']} {d['phase']}: dense on rank {rank_ranges(d['dense_ranks'])}, "
                    f"fused on rank {rank_ranges(d['fused_ranks'])}"
                )
        else:
            out.append("  ranks agree on every layer/phase")

    shown = 0
    for c in rep["crashes"]:
        if shown >= MAX_CRASHES_SHOWN:
            out.append(f"\n(+{len(rep['crashes']) - shown} more crash/stop sections in --format json)")
            break
        shown += 1
        out.append("")
        if c["kind"] == "crash":
            ev = c["crash"] or {}
            thread = f" in thread {ev.get('thread')}" if ev.get("thread") not in (None, "MainThread") else ""
            out.append(f"CRASH {_who(c)}{thread} at {fmt_ts(ev.get('ts'))}")
            out.append(f"  {ev.get('exc_type')}: {str(ev.get('message') or '').split(_ESCAPED_NEWLINE)[0]}")
            if ev.get("diagnosis"):
                out.append(f"  diagnosis: {ev['diagnosis']}")
            lf = ev.get("last_flex")
            if isinstance(lf, dict):
                out.append(
                    f"  last FlexAttention event: {lf.get('event')} {lf.get('path')} {lf.get('phase')} of {lf.get('layer') or NO_LAYER}"
                    + (f", cause {lf['cause']}" if lf.get("cause") else "")
                    + (f", scores {human_bytes(lf['scores_bytes'])}" if lf.get("scores_bytes") is not None else "")
                    + (f", at {site_text(lf.get('call_site'))}" if site_text(lf.get("call_site")) else "")
                )
            cuda = ev.get("cuda")
            if isinstance(cuda, dict):
                out.append(
                    f"  CUDA memory: allocated {human_bytes(cuda.get('allocated'))}, reserved {human_bytes(cuda.get('reserved'))}, "
                    f"peak {human_bytes(cuda.get('peak'))}"
                )
            if ev.get("frames"):
                out.append(f"  raised at: {ev['frames'][-1]}")
            t0 = ev.get("ts")
            label = "before the crash"
        else:
            last = c["last_events"][-1] if c["last_events"] else {}
            out.append(f"STOPPED {_who(c)}: the log ends at {fmt_ts(last.get('ts'))} without a shutdown event")
            if c.get("forked_from") is not None:  # a forked worker ends with os._exit: no exit handlers
                out.append(
                    f"  (forked from pid {c['forked_from']}: a worker that ended with os._exit, or killed: "
                    "SIGKILL, the OOM killer, a node failure, or still running)"
                )
            else:
                out.append("  (killed: SIGKILL, the OOM killer, a node failure, or the process is still running)")
            t0 = last.get("ts")
            label = "last events"
        if c["last_events"]:
            out.append(f"  {label} (time relative to {'the crash' if c['kind'] == 'crash' else 'the last event'}):")
            for e in c["last_events"]:
                out.append("    " + _event_line(e, t0 if isinstance(t0, (int, float)) else None))
    return "\n".join(out) + "\n"


def _total(rep: Dict[str, Any], listed: List[Any], key: str, at_least_key: str) -> Tuple[int, str]:
    """(how many, ``"at least "`` or ``""``): the exact total of ``totals[key]``, not the listed examples."""
    totals = rep.get("totals") or {}
    n = totals.get(key)
    return (n if isinstance(n, int) and n >= len(listed) else len(listed)), ("at least " if totals.get(at_least_key) else "")


def pressure_line(frames: List[Dict[str, Any]], n: Optional[int] = None, at_least: str = "") -> str:
    """``recompile pressure: 1 frame at 4 of 8 compiles (q dim 2 varies)``; ``n``: the total
    (the listed ``frames`` may be capped)."""
    n = len(frames) if n is None else n
    counts = {(f.get("compiles"), f.get("limit")) for f in frames}
    top = frames[0]
    at = f"at {top.get('compiles') or '?'} of {top.get('limit') or '?'} compiles"
    if len(counts) > 1:
        at = "up to " + at[3:]
    varies = "; ".join(dict.fromkeys(str(f["varies"]) for f in frames if f.get("varies")))
    return f"recompile pressure: {at_least}{n:,} frame{'s' if n != 1 else ''} {at}" + (f" ({varies})" if varies else "")


def oom_line(rep: Dict[str, Any]) -> str:
    """``oom mode: 1 dense call(s) blocked (needed 9.1 GB, the device could give 4.0 GB)``: calls
    the oom mode blocked as predicted not to fit, told apart from strict mode's blocks."""
    o = rep.get("oom") or {}
    n = (rep.get("totals") or {}).get("oom_blocked_calls") or o.get("blocked") or 0
    numbers = []
    if o.get("needed_bytes") is not None:
        numbers.append(f"needed {human_bytes(o['needed_bytes'])}")
    if o.get("free_bytes") is not None:
        numbers.append(f"the device could give {human_bytes(o['free_bytes'])}")
    where = " ".join(str(x) for x in (o.get("layer"), o.get("phase")) if x)
    site = f" at {o['call_site']}" if o.get("call_site") else ""
    detail = f" ({', '.join(numbers)}" + (f"; {where}" if where else "") + f"{site})" if numbers else ""
    return f"oom mode: {n:,} dense call(s) blocked, predicted not to fit{detail}"


def notice_lines(rep: Dict[str, Any]) -> List[str]:
    """Every finding beside the per-layer counts, as ``render_text`` words it: recompile
    pressure, models without FlexAttention, eager mask builds, the oom mode's blocks (for the
    HTML page; strings as they are in ``rep``: escape them for the medium)."""
    out = early_lines(rep)
    masks = rep.get("masks") or {}
    if masks.get("dense"):  # (builds below mask_limit are logged, not a finding)
        out.append(masks_text(masks))
    if (rep.get("totals") or {}).get("oom_blocked_calls"):
        out.append(oom_line(rep))
    return out


def early_lines(rep: Dict[str, Any]) -> List[str]:
    """What was seen coming before any dense call: recompile pressure, models that never called
    FlexAttention (strings already escaped)."""
    out: List[str] = []
    frames = rep.get("recompile_pressure") or []
    if frames:
        n, at_least = _total(rep, frames, "recompile_pressure_frames", "recompile_pressure_frames_at_least")
        out.append(pressure_line(frames, n, at_least))
        for f in frames[:10]:
            out.append(
                f"  {f.get('function')} ({f.get('file')}:{f.get('line')}): {f.get('compiles') or '?'} of "
                f"{f.get('limit') or '?'} compiles; {f.get('reason') or 'reason unknown'}"
            )
            if f.get("fix"):
                out.append(f"    fix: {f['fix']}")
        if n > 10:
            out.append(f"  ... and {at_least}{n - 10:,} more frame(s)")
    models = rep.get("no_flex_calls") or []
    if models:
        n, at_least = _total(rep, models, "no_flex_models", "no_flex_models_at_least")
        out.append(f"no FlexAttention: {at_least}{n:,} watched model{'s' if n != 1 else ''} ran a forward without any FlexAttention call")
        for m in models[:10]:
            impl = f" (config._attn_implementation={m['attn_implementation']!r})" if m.get("attn_implementation") else ""
            out.append(f"  {m.get('model')}{impl}")
        if n > 10:
            out.append(f"  ... and {at_least}{n - 10:,} more model(s)")
    return out


def devices_line(devices: Dict[str, List[str]]) -> str:
    """Each host's devices (``node1: 8× NVIDIA H200``) when that fits in ``DEVICES_WIDTH``
    characters; otherwise counts by device kind and the number of hosts (512 hosts made a line
    of 7,179 characters). Each host's list stays in ``--format json``."""
    per_host = "; ".join(f"{h}: " + _devices_text(d) for h, d in sorted(devices.items()))
    if len(per_host) <= DEVICES_WIDTH:
        return per_host
    counts: Dict[str, int] = {}
    for names in devices.values():
        for n in names:
            counts[n] = counts.get(n, 0) + 1
    kinds = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    shown = [f"{n:,}× {k if len(k) <= 60 else k[:59] + '…'}" for k, n in kinds[:MAX_DEVICE_KINDS]]
    rest = kinds[MAX_DEVICE_KINDS:]
    if rest:
        shown.append(f"{sum(n for _, n in rest):,} of {len(rest):,} other kind{'s' if len(rest) != 1 else ''}")
    return f"{', '.join(shown)} on {len(devices):,} hosts (per host: --format json)"


def _devices_text(names: List[str]) -> str:
    counts: Dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    return ", ".join(f"{v}× {k}" if v > 1 else k for k, v in counts.items())


# -- csv and json --------------------------------------------------------------------------------

CSV_COLUMNS = (
    "layer",
    "phase",
    "dense",
    "allowed",
    "blocked",
    "fused",
    "compiles",
    "causes",
    "alloc_delta_median",
    "alloc_delta_max",
    "peak_delta_median",
    "peak_delta_max",
    "scores_bytes_max",
    "first_dense_call_site",
    "dense_ranks",
    "fused_ranks",
)


def masks_text(m: Dict[str, Any]) -> str:
    """The mask line: eager (dense) builds over ``mask_limit`` or that would not fit (a finding:
    ``DENSE MASKS``), the largest estimate, the first call site; builds below the limit (logged,
    not a finding: a small mask built once is fine); compiled ones."""
    small = m.get("small") or 0
    small_big = f", largest {human_bytes(m['small_estimated_max'])}" if m.get("small_estimated_max") else ""
    small_text = f"{small:,} eager mask build(s) below mask_limit{small_big}" if small else ""
    if not m.get("dense"):
        parts = [p for p in (small_text, f"{m.get('compiled', 0):,} compiled" if m.get("compiled") else "") if p]
        return "masks: " + ("; ".join(parts) if small else f"{m.get('compiled', 0):,} compiled mask build(s), none eager")
    blocked = f" ({m['blocked']:,} blocked)" if m.get("blocked") else ""
    big = f", largest {human_bytes(m['estimated_max'])} estimated" if m.get("estimated_max") else ""
    site = f", first at {m['first_call_site']}" if m.get("first_call_site") else ""
    compiled = f"; {m['compiled']:,} compiled" if m.get("compiled") else ""
    compiled += f"; {small_text}" if small else ""
    return (
        f"DENSE MASKS: {m['dense']:,} eager mask build(s){blocked}{big}{site}{compiled} "
        "(fix: compile create_block_mask, build the mask once)"
    )


def render_csv(rep: Dict[str, Any]) -> str:
    """One line per (layer, phase) row, ``CSV_COLUMNS``; causes as ``cause=n;...``."""
    rep = escaped(rep)  # as in text: a log's ESC sequences never reach a terminal
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for r in rep["rows"]:
        cells = []
        for col in CSV_COLUMNS:
            v = r.get(col)
            if col == "causes":
                v = ";".join(f"{k}={n}" for k, n in v.items())
            elif col in ("dense_ranks", "fused_ranks"):
                v = ";".join(str(x) for x in v)
            cells.append("" if v is None else v)
        w.writerow(cells)
    return buf.getvalue()


_JSON_UNSAFE = re.compile(f"[{UNSAFE_ABOVE_C0}]")  # json.dumps escapes C0 itself (and its indent is newlines)


def render_json(rep: Dict[str, Any]) -> str:
    """JSON; C1 controls, DEL, direction and invisible characters written as ``\\uXXXX`` escapes (the
    decoded data is the same; a terminal showing it is never driven by a log's strings)."""
    text = json.dumps(rep, indent=1, ensure_ascii=False, default=str)
    return _JSON_UNSAFE.sub(lambda m: _json_escape(ord(m.group())), text) + "\n"


def _json_escape(c: int) -> str:
    """``\\uXXXX``, or a surrogate pair past the BMP (a tag character): JSON has no longer escape."""
    if c < 0x10000:
        return f"\\u{c:04x}"
    c -= 0x10000
    return f"\\u{0xD800 + (c >> 10):04x}\\u{0xDC00 + (c & 0x3FF):04x}"
