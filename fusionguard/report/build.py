"""The report itself: one plain dict (``--format json`` is exactly this), built from an
``Aggregator``. Rows per (layer, phase) in a stable order, per-rank views and disagreements,
run metadata (versions, devices, schemas), every warning about the input, and how each
process ended (a crash, a native crash found beside the log, a shutdown, or stopped).
Renderers (``render``, ``plot``) only format what is here.
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict, Iterable, List, Optional, Tuple

from fusionguard.eventlog.formatting import site_text
from fusionguard.report import aggregate
from fusionguard.report.aggregate import MAX_KEYS, NO_LAYER, OTHER_LAYERS, Aggregator, LayerTally, Stream, compact
from fusionguard.report.crashfile import native_crash
from fusionguard.report.read import SUPPORTED_SCHEMA, ReportError, find_logs

REPORT_VERSION = 2  # 2: rows' fused = calls (never compile records), allowed apart from dense
_PHASE_ORDER = {"forward": 0, "backward": 1}
_DIGITS = re.compile(r"[0-9]+")
_DIGIT_SPLIT = re.compile(r"([0-9]+)")


def natural_key(text: str) -> Tuple:
    """Layer names in reading order (``layers.2`` before ``layers.10``), the catch-alls last."""
    if text in (NO_LAYER, OTHER_LAYERS):
        return (1, text)
    # [0-9] only: str.isdigit() is also true for "²", which int() refuses
    return (0,) + tuple((0, int(p), "") if _DIGITS.fullmatch(p) else (1, 0, p) for p in _DIGIT_SPLIT.split(text))


def _int(x: Any) -> Optional[int]:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _main_thread_crash(c: Dict[str, Any]) -> bool:
    ev = c.get("event") or {}
    return ev.get("where") == "sys.excepthook" or ev.get("thread") in (None, "MainThread")


def _ending(s: Stream) -> str:
    """``crash`` (an uncaught exception ended the main thread), else how the log ends:
    a shutdown reason (``exit``, ``disable``, ``sigterm``) or ``stopped`` (no shutdown: killed),
    plus `` after thread crash`` when only another thread died of an exception."""
    if s.synthetic:
        return "summary only"
    if any(_main_thread_crash(c) for c in s.crashes):
        return "crash"
    base = (s.last_shutdown or "shutdown") if s.last_kind == "shutdown" else "stopped"
    return f"{base} after thread crash" if s.crashes else base


def build_report(agg: Aggregator) -> Dict[str, Any]:
    """The report dict of a finished ``Aggregator`` (``build`` reads the files first)."""
    streams = [s for s in agg.streams.values()]
    ranks = _sorted_ranks({s.rank for s in streams})
    multi_rank = len(ranks) > 1

    # per key totals over processes, and which ranks went which way
    rows: List[Dict[str, Any]] = []
    per_rank: Dict[Any, Dict[Tuple[str, str], List[int]]] = {}
    for key in sorted(agg.keys, key=lambda k: (natural_key(k[0]), _PHASE_ORDER.get(k[1], 9), k[1])):
        total = LayerTally()
        dense_ranks, fused_ranks = set(), set()
        for s in streams:
            c = s.counts.get(key)
            if c is None:
                continue
            total.dense += c.dense
            total.allowed += c.allowed
            total.fused += c.fused
            total.compiles += c.compiles
            total.blocked += c.blocked
            total.oom_blocked += c.oom_blocked
            total.inlined += c.inlined
            for k, v in c.causes.items():
                total.causes[k] = total.causes.get(k, 0) + v
            pr = per_rank.setdefault(s.rank, {}).setdefault(key, [0, 0])
            pr[0] += c.dense
            pr[1] += c.fused + c.compiles
        for r, keys in per_rank.items():
            d, f = keys.get(key, (0, 0))
            if d:
                dense_ranks.add(r)
            elif f:
                fused_ranks.add(r)
        if not (
            total.dense or total.allowed or total.fused or total.compiles or total.inlined or agg.keys[key].alloc.n or agg.keys[key].peak.n
        ):
            continue  # a key only a dense recompute's or an odd record's
        ks = agg.keys[key]
        fd = ks.first_dense
        rows.append(
            {
                "layer": key[0],
                "phase": key[1],
                "dense": total.dense,
                "allowed": total.allowed,
                "blocked": total.blocked,
                "oom_blocked": total.oom_blocked,
                "fused": total.fused,
                "compiles": total.compiles,
                "inlined": total.inlined,
                "causes": dict(sorted(total.causes.items(), key=lambda kv: (-kv[1], kv[0]))),
                "alloc_delta_median": ks.alloc.median(),
                "alloc_delta_max": ks.alloc.max,
                "peak_delta_median": ks.peak.median(),
                "peak_delta_max": ks.peak.max,
                "memory_samples": max(ks.alloc.n, ks.peak.n),
                "scores_bytes_max": ks.scores_max,
                "predicted_bytes_max": ks.predicted_max,
                "templates": sorted(ks.templates),
                "first_dense": fd,
                "first_dense_call_site": site_text(fd.get("call_site")) if fd else None,
                "dense_ranks": _sorted_ranks(dense_ranks),
                "fused_ranks": _sorted_ranks(fused_ranks),
            }
        )

    rank_rows = []
    disagreements = []
    if multi_rank:
        for r in ranks:
            dense: List[Dict[str, Any]] = [
                {"layer": k[0], "phase": k[1], "dense": v[0]}
                for k, v in sorted(per_rank.get(r, {}).items(), key=lambda kv: (natural_key(kv[0][0]), _PHASE_ORDER.get(kv[0][1], 9)))
                if v[0]
            ]
            rank_rows.append({"rank": r, "dense_calls": sum(d["dense"] for d in dense), "dense": dense})
        for row in rows:
            if row["dense_ranks"] and row["fused_ranks"]:
                disagreements.append(
                    {"layer": row["layer"], "phase": row["phase"], "dense_ranks": row["dense_ranks"], "fused_ranks": row["fused_ranks"]}
                )

    # runs: versions, devices, hosts
    versions: Dict[Tuple, int] = {}
    devices: Dict[str, List[str]] = {}
    world = None
    for s in streams:
        h = s.header
        if h:
            vkey = (h.get("fusionguard"), h.get("torch"), h.get("triton"), h.get("python"))
            versions[vkey] = versions.get(vkey, 0) + 1
            cuda_field = h.get("cuda")
            cuda: Dict[str, Any] = cuda_field if isinstance(cuda_field, dict) else {}
            host = str(h.get("hostname") or s.host or "?")
            names = cuda.get("devices") if isinstance(cuda.get("devices"), list) else None
            if names is None:
                names = [f"{cuda.get('count')} CUDA device(s), not initialised"] if cuda.get("available") else ["cpu"]
            if len(names) > len(devices.get(host, [])):
                devices[host] = [str(n) for n in names]
            ws = _int(h.get("world_size"))
            if ws is not None:
                world = max(world or 0, ws)
    schemas: Dict[str, int] = {}
    for fs in agg.files:
        for k in fs.schemas:
            schemas[k] = schemas.get(k, 0) + 1
    warnings = list(agg.notes)
    numeric = [int(k) for k in schemas if len(k) < 20 and _DIGITS.fullmatch(k)]  # not isdigit(): "²"
    if len([k for k in schemas if k != "none"]) > 1:
        warnings.append("mixed schema versions: " + ", ".join(f"{k} ({n} file{'s' if n > 1 else ''})" for k, n in sorted(schemas.items())))
    if numeric and max(numeric) > SUPPORTED_SCHEMA:
        warnings.append(
            f"schema {max(numeric)} is newer than this report understands ({SUPPORTED_SCHEMA}): known fields are read, others ignored"
        )
    corrupt = sum(f.corrupt for f in agg.files)
    torn = [f.path for f in agg.files if f.torn_last_line]
    if corrupt:
        where = ", ".join(f"{os.path.basename(f.path)}:{ln}" for f in agg.files for ln in f.corrupt_lines)
        warnings.append(f"{corrupt} corrupt line{'s' if corrupt > 1 else ''} skipped ({where}{', ...' if corrupt > 5 else ''})")
    if torn:
        warnings.append(f"torn last line (a write cut short by a crash) in {', '.join(os.path.basename(p) for p in torn)}")
    if agg.ignored:
        shown = ", ".join(f"{os.path.basename(i['path'])} ({i['reason']})" for i in agg.ignored[:5])
        more = f", +{len(agg.ignored) - 5} more" if len(agg.ignored) > 5 else ""
        warnings.append(
            f"ignored {len(agg.ignored)} input{'s' if len(agg.ignored) > 1 else ''} "
            f"that {'are' if len(agg.ignored) > 1 else 'is'} not a fusionguard log: {shown}{more}"
        )
    if agg.errors:
        warnings.append(f"{agg.errors} event(s) with fields this report could not read were skipped (counted as corrupt lines)")
    if agg.unknown:
        warnings.append("unknown event kinds ignored: " + ", ".join(f"{k} ({v})" for k, v in sorted(agg.unknown.items())))
    if agg.key_overflow:
        warnings.append(f"more than {MAX_KEYS} layer/phase pairs: the rest are counted under {OTHER_LAYERS!r}")
    for what, label in (("pressure", "recompile-pressure frames"), ("no_flex", "watched models without FlexAttention")):
        if what in agg.distinct_full:
            warnings.append(
                f"at least {len(agg.distinct[what]):,} {label}: more than {aggregate.MAX_DISTINCT:,} distinct ones, the rest not counted"
            )
    if agg.kinds.get("partial_names"):  # (layer names without watch(): see docs/compiled.md)
        warnings.append(
            "some layer names are partial (Class[i]...: the model holding them was not known); fusionguard.watch(model) gives full names"
        )
    if agg.kinds.get("internal_error"):
        warnings.append(f"{agg.kinds['internal_error']} fusionguard internal_error event(s): see the log")

    endings = []
    crashes = []
    for s in sorted(streams, key=lambda s: (str(s.rank), str(s.host), str(s.pid))):
        native = native_crash(s.header.get("crash_file"), s.files, s.recent)  # a segfault/abort
        if native is not None:
            s.crashes.append({"event": native, "before": [compact(x) for x in s.recent]})
            s.crash_count += 1
        ending = _ending(s)
        endings.append(
            {
                "host": s.host,
                "pid": s.pid,
                "rank": s.rank,
                "ending": ending,
                "events": s.events,
                "first_ts": s.first_ts,
                "last_ts": s.last_ts,
                "crashes": s.crash_count,
                "files": list(s.files),
                "missing_lines": s.missing_lines,
                "own_final_counts": s.trusted_summary,
            }
        )
        for cr in s.crashes:
            crashes.append(
                {"host": s.host, "pid": s.pid, "rank": s.rank, "kind": "crash", "crash": cr["event"], "last_events": cr["before"]}
            )
        if ending.startswith("stopped"):
            crashes.append(
                {
                    "host": s.host,
                    "pid": s.pid,
                    "rank": s.rank,
                    "kind": "stopped",
                    "crash": None,
                    "last_events": [compact(x) for x in s.recent],
                    "forked_from": _int(s.header.get("forked_from")),
                }
            )

    missing = sum(e["missing_lines"] for e in endings)
    if missing:
        warnings.append(_missing_text(endings, missing))
    total_dense = sum(r["dense"] for r in rows)
    return {
        "report_version": REPORT_VERSION,
        "run": {
            "files": sum(1 for f in agg.files if f.known),
            "processes": len([s for s in streams if not s.synthetic]),
            "ranks": ranks,
            "world_size": world,
            "hosts": sorted({str(s.host) for s in streams if s.host is not None}),
            "versions": [
                {"fusionguard": v[0], "torch": v[1], "triton": v[2], "python": v[3], "processes": n}
                for v, n in sorted(versions.items(), key=lambda kv: -kv[1])
            ],
            "devices": devices,
            "schemas": schemas,
            "first_ts": agg.first_ts,
            "last_ts": agg.last_ts,
            "duration_s": (agg.last_ts - agg.first_ts) if agg.first_ts is not None and agg.last_ts is not None else None,
            "events": sum(f.events for f in agg.files),
            "missing_lines": missing,
            "event_kinds": dict(sorted(agg.kinds.items())),
        },
        "totals": {
            "dense_calls": total_dense,
            "dense_pairs": sum(1 for r in rows if r["dense"]),
            "blocked_calls": sum(r["blocked"] for r in rows),
            "oom_blocked_calls": sum(r["oom_blocked"] for r in rows),
            "allowed_dense_calls": sum(r["allowed"] for r in rows),
            "fused_calls": sum(r["fused"] for r in rows),
            "compiles": sum(r["compiles"] for r in rows),
            "causes": _sum_causes(rows),
            "scores_bytes_max": max((r["scores_bytes_max"] for r in rows if r["scores_bytes_max"] is not None), default=None),
            "predicted_bytes_max": max((r["predicted_bytes_max"] for r in rows if r["predicted_bytes_max"] is not None), default=None),
            # exact up to MAX_DISTINCT distinct keys (then "at least"); the lists below are capped examples
            "recompile_pressure_frames": len(agg.distinct["pressure"]),
            "recompile_pressure_frames_at_least": "pressure" in agg.distinct_full,
            "no_flex_models": len(agg.distinct["no_flex"]),
            "no_flex_models_at_least": "no_flex" in agg.distinct_full,
        },
        "recompile_pressure": sorted(agg.pressure.values(), key=lambda p: (-(p["compiles"] or 0), str(p["file"]), p["line"] or 0)),
        "no_flex_calls": sorted(agg.no_flex.values(), key=lambda m: (str(m["model"]), str(m["attn_implementation"]))),
        "oom": {
            **{k: v for k, v in agg.oom.items() if k != "call_site"},
            "call_site": site_text(agg.oom["call_site"]) if agg.oom["call_site"] else None,
        },
        "masks": {
            **{k: v for k, v in agg.masks.items() if k != "call_site"},
            "first_call_site": site_text(agg.masks["call_site"]) if agg.masks["call_site"] else None,
        },
        "rows": rows,
        "ranks": rank_rows,
        "disagreements": disagreements,
        "endings": endings,
        "crashes": crashes,
        "files": [f.to_dict() for f in agg.files if f.known],
        "ignored": list(agg.ignored),
        "warnings": warnings,
        "first_events": sorted(agg.firsts.values(), key=lambda e: (e.get("ts") is None, e.get("ts") or 0.0, str(e.get("event")))),
    }


def _missing_text(endings: List[Dict[str, Any]], missing: int) -> str:
    """The lines missing from the logs (gaps in processes' seq numbers), and what the counts
    rest on: never a silent shortfall."""
    gapped = [e for e in endings if e["missing_lines"]]
    own = [e for e in gapped if e["own_final_counts"]]
    rest = [e for e in gapped if not e["own_final_counts"]]
    n = len(gapped)
    parts = [f"{missing:,} log line{'s' if missing != 1 else ''} missing (gaps in the seq numbers of {n} process{'es' if n != 1 else ''})"]
    if own:
        parts.append(
            f"{len(own)} of them lost early lines to rotation (the log's oldest parts were pruned): their own final counts "
            "(the summary each wrote at its end) are used"
        )
    if rest:
        pids = ", ".join(str(e["pid"]) for e in rest[:5]) + (", ..." if len(rest) > 5 else "")
        parts.append(
            f"pid {pids}: no final summary covers them (rotation's pruned parts of a process killed before its summary, "
            "a failed write, a file missing from the input): the counts hold only the lines that are there"
        )
    return "; ".join(parts)


def _sorted_ranks(ranks: Iterable[Any]) -> List[Any]:
    return sorted(ranks, key=lambda r: (not isinstance(r, int), r if isinstance(r, int) else str(r)))


def _sum_causes(rows: List[Dict[str, Any]]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for r in rows:
        for k, v in r["causes"].items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def build(paths: Iterable[str], last: int = 10) -> Dict[str, Any]:
    """Read every log under ``paths`` and return the report dict (``--format json``). Raises
    ReportError when no input holds a fusionguard event (exit status 2: nothing to report on)."""
    agg = Aggregator(last=last)
    files = find_logs(paths, agg.notes, agg.ignored)
    for f in files:
        try:
            agg.read(f)
        except OSError as exc:
            if agg.files and agg.files[-1].path == f and not agg.files[-1].lines:
                agg.files.pop()
            agg.ignored.append({"path": f, "reason": f"unreadable: {exc.strerror or exc}"})
    if not any(f.known for f in agg.files):
        what = "; ".join(f"{i['path']}: {i['reason']}" for i in agg.ignored[:5]) or "no input"
        raise ReportError(f"no fusionguard events in the input ({what})")
    agg.finish()
    return build_report(agg)
