"""Folding events into counts: per process (host, pid, rank) and per (layer, phase).

Everything here is bounded whatever the log's length: a fixed-size ``Reservoir`` of memory
figures per (layer, phase), the last ``last`` events per process, at most ``MAX_KEYS`` distinct
(layer, phase) keys. The same call is often seen from several sides (a flex_run, a layer's
record, the process's own ``summary`` rows); the rules that count it once live here
(``LayerTally.event_fused``, ``Aggregator._settle``).
"""

from __future__ import annotations

import collections
import re
from typing import Any, Deque, Dict, List, Optional, Set, Tuple

from fusionguard.eventlog.kinds import KNOWN_EVENTS, NO_LAYER
from fusionguard.report.read import FileStats, read_events
from fusionguard.report.reservoir import Reservoir

_ROTATED_PART = re.compile(r"^(.+\.jsonl)\.\d+$")
MAX_KEYS = 10_000
#: Distinct recompile-pressure frames / no-FlexAttention models counted exactly (a hash each, about
#: 60 MB at the bound); past it their totals are lower bounds ("at least"), with a warning.
MAX_DISTINCT = 1_000_000
OTHER_LAYERS = "(other layers)"


def _text(x: Any, n: int = 300) -> Optional[str]:
    """A string field of a log line (anything else: None), cut to ``n``."""
    return x[:n] if isinstance(x, str) else None


def _count(x: Any) -> Optional[int]:
    """A non-negative integer field of a log line (anything else: None)."""
    return x if isinstance(x, int) and not isinstance(x, bool) and x >= 0 else None


def _short(x: Any, n: int = 200) -> Any:
    if isinstance(x, str) and len(x) > n:
        return x[: n - 3] + "..."
    return x


class LayerTally:
    """One process's counts for one (layer, phase), read from its log (a session's live counts are
    ``fusionguard.session.Counts``; here ``fused`` is settled from several sources: ``event_fused``)."""

    __slots__ = (
        "dense",
        "allowed",
        "blocked",
        "oom_blocked",
        "causes",
        "runs",
        "rescued",
        "layer_calls",
        "summary_fused",
        "fused",
        "compiles",
        "inlined",
    )

    def __init__(self) -> None:
        self.dense = 0  # dense calls that were not allowed (warned or blocked)
        self.allowed = 0  # dense calls inside allow_dense() (or the debug flag): on purpose
        self.blocked = 0
        self.oom_blocked = 0  # of the blocked: by the oom mode (predicted not to fit), not by strict mode
        self.causes: Dict[str, int] = {}  # of the dense (not allowed) calls
        self.runs = 0  # fused calls executed by compiled graphs (flex_run, its counters)
        self.rescued = 0  # rescued calls (flex_call path "rescued")
        self.layer_calls = 0  # watched layer calls that ran no dense kernel (layer_memory, its counters)
        self.summary_fused: Optional[int] = None  # the process's own summary() row
        self.fused = 0  # the fused calls, once every source is read (Aggregator.finish)
        self.compiles = 0  # compile records (flex_compile): compiled graphs, never calls
        self.inlined = 0

    def event_fused(self) -> int:
        """Fused calls from this process's events. The three sources see the same calls from
        different sides (a rescued call also runs a compiled graph; a watched layer calling a
        compiled flex_attention is one layer call and one graph run): the largest, never the sum."""
        return max(self.runs, self.rescued, self.layer_calls)


class KeyStats:
    """Across all processes, per (layer, phase): memory and the first dense call."""

    __slots__ = ("alloc", "peak", "scores_max", "predicted_max", "first_dense", "templates")

    def __init__(self) -> None:
        self.alloc = Reservoir()
        self.peak = Reservoir()
        self.scores_max: Optional[int] = None
        self.predicted_max: Optional[int] = None  # the largest predicted extra peak of a dense call (#25 part 4)
        self.first_dense: Optional[Dict[str, Any]] = None
        self.templates: Dict[str, int] = {}


class SeqSpan:
    """One process's ``seq`` numbers in one log path (its rotated parts together): what was seen
    tells how many lines are missing. Files are read oldest part first and a process writes its
    lines in ``seq`` order, so rotation's pruned parts leave a gap before the first line seen
    (``before``) and nothing else does; a failed write leaves one between lines (``between``).
    A process's ``seq`` runs on across ``enable()`` calls, so a gap that a header ends (a
    notebook's enable / disable cycles, another log path in between) may hold lines that went to
    another log or none: ``elsewhere`` (see ``Stream.missing_lines``)."""

    __slots__ = ("first", "last", "between", "rotated", "elsewhere")

    def __init__(self) -> None:
        self.first: Optional[int] = None
        self.last: Optional[int] = None
        self.between = 0
        self.rotated = False  # a rotated part of the path was read, or a header copy seen
        self.elsewhere = 0  # of before + between: the gaps that a header of this process ends

    def add(self, seq: int, opens: bool = False) -> None:
        """``opens``: the line is a header: an ``enable()`` of this process starts a log of its own in this path."""
        last = self.last
        if last is None:
            self.first = self.last = seq
            if opens:
                self.elsewhere += max(seq - 1, 0)
        elif seq > last:
            self.between += seq - last - 1
            if opens:
                self.elsewhere += seq - last - 1
            self.last = seq
        elif self.first is not None and seq < self.first:  # (never in order; counted, not trusted)
            self.between += self.first - seq - 1
            self.first = seq

    @property
    def before(self) -> int:
        return (self.first - 1) if self.first is not None and self.first > 1 else 0


class Stream:
    """One process's events (hostname, pid, rank)."""

    def __init__(self, key: Tuple[Any, Any, Any], last: int) -> None:
        self.host, self.pid, self.rank = key
        self.events = 0
        self.first_ts: Optional[float] = None
        self.last_ts: Optional[float] = None
        self.last_seq: Optional[int] = None
        self.last_kind: Optional[str] = None
        self.last_shutdown: Optional[str] = None
        self.recent: Deque[dict] = collections.deque(maxlen=last)
        self.crashes: List[Dict[str, Any]] = []
        self.crash_count = 0
        self.counts: Dict[Tuple[str, str], LayerTally] = {}
        self.summary_rows: Optional[List[dict]] = None
        self.header: Dict[str, Any] = {}
        self.files: List[str] = []
        self.synthetic = False
        self.spans: Dict[str, SeqSpan] = {}  # per log path (rotated parts together): its seq numbers
        self.trusted_summary = False  # its own final counts taken (rotation pruned its early lines)

    @property
    def missing_lines(self) -> int:
        """Lines of this process missing from the logs read: gaps in its ``seq`` numbers. A gap
        that a header ends is not missing when no log of the process rotated: its lines went to
        another log path, or to none (``log_path=False``); rotation could have pruned them."""
        gaps = sum(sp.before + sp.between for sp in self.spans.values())
        if any(sp.rotated for sp in self.spans.values()):
            return gaps
        return gaps - sum(sp.elsewhere for sp in self.spans.values())

    def count(self, key: Tuple[str, str]) -> LayerTally:
        c = self.counts.get(key)
        if c is None:
            c = self.counts[key] = LayerTally()
        return c


_COMPACT = ("seq", "ts", "event", "level", "layer", "phase", "path", "cause", "thread")
_EXTRA = {
    "flex_call": ("action", "scores_bytes", "predicted_bytes", "free_bytes", "blocked_by"),
    "layer_memory": ("alloc_delta", "peak_delta", "recompute"),
    "fused_calls": ("count", "total"),
    "dense_calls": ("count", "total", "action"),
    "shutdown": ("reason",),
    "crash": ("exc_type", "diagnosis", "where"),
    "internal_error": ("where", "error"),
    "recompile_limit": ("function", "reason"),
    "recompile_pressure": ("function", "compiles", "limit", "varies"),
    "no_flex_calls": ("model", "attn_implementation"),
    "graph_break": ("function", "reason"),
    "compile_error": ("function", "error"),
    "flex_compile": ("template", "source"),
}


def compact(e: dict) -> Dict[str, Any]:
    """The fields of an event worth showing in a crash's "last events" (long strings cut)."""
    out = {k: _short(e[k]) for k in _COMPACT if k in e and e[k] is not None}
    for k in _EXTRA.get(e.get("event"), ()):  # type: ignore[arg-type]
        if e.get(k) is not None:
            out[k] = _short(e[k])
    return out


class Aggregator:
    """Every input file's events, folded one at a time (``read``), then settled (``finish``)."""

    def __init__(self, last: int = 10) -> None:
        self.last = last
        self.files: List[FileStats] = []
        self.streams: Dict[Tuple[Any, Any, Any], Stream] = {}
        self.keys: Dict[Tuple[str, str], KeyStats] = {}
        self.kinds: Dict[str, int] = {}
        # eager mask builds (mask_build / its sampled counter mask_builds) and compiled ones
        self.masks: Dict[str, Any] = {
            "dense": 0,
            "compiled": 0,
            "blocked": 0,
            "estimated_max": None,
            "call_site": None,
            "small": 0,
            "small_estimated_max": None,
        }
        self.unknown: Dict[str, int] = {}
        self.first_ts: Optional[float] = None
        self.last_ts: Optional[float] = None
        self.host_of_pid: Dict[Any, Any] = {}
        self.key_overflow = 0
        self.notes: List[str] = []
        self.ignored: List[Dict[str, str]] = []  # inputs that are not fusionguard logs, and why
        self.errors = 0  # events the aggregation could not take (counted as corrupt lines)
        self.firsts: Dict[str, Dict[str, Any]] = {}  # per known event kind, its earliest event (compacted)
        self.pressure: Dict[Tuple[Any, Any, Any], Dict[str, Any]] = {}  # recompile_pressure, per frame
        self.no_flex: Dict[Tuple[Any, Any], Dict[str, Any]] = {}  # no_flex_calls, per model and implementation
        # every distinct frame / model, by hash: exact totals beyond the MAX_KEYS listed above
        self.distinct: Dict[str, Set[int]] = {"pressure": set(), "no_flex": set()}
        self.distinct_full: Set[str] = set()  # which of them went past MAX_DISTINCT
        # dense calls the oom mode blocked (blocked_by "oom"): how many, and the one that needed most
        self.oom: Dict[str, Any] = {"blocked": 0, "needed_bytes": None, "free_bytes": None, "layer": None, "phase": None, "call_site": None}

    # keys
    def _key(self, e: dict) -> Tuple[str, str]:
        layer = e.get("layer")
        layer = NO_LAYER if layer is None else str(layer)
        phase = e.get("phase")
        phase = "?" if phase is None else str(phase)
        return self._named(layer, phase)

    def _named(self, layer: str, phase: str) -> Tuple[str, str]:
        key = (layer, phase)
        if key not in self.keys:
            if len(self.keys) >= MAX_KEYS:
                self.key_overflow += 1
                key = (OTHER_LAYERS, phase)
                if key not in self.keys:
                    self.keys[key] = KeyStats()
            else:
                self.keys[key] = KeyStats()
        return key

    def read(self, path: str) -> None:
        stats = FileStats(path)
        self.files.append(stats)
        m = _ROTATED_PART.match(path)
        base, rotated_part = (m.group(1), True) if m else (path, False)
        file_hosts: Dict[Any, Any] = {}
        file_streams: Dict[Any, Stream] = {}  # pid -> its latest stream in this file
        stream: Optional[Stream] = None
        sid: Any = None
        lineno = 0
        for e in read_events(path, stats):
            lineno = stats.lines
            kind = e["event"]
            if kind in KNOWN_EVENTS:
                stats.known += 1
            elif not stats.known:
                continue  # someone else's JSON lines (until a fusionguard event says otherwise)
            pid, rank = e.get("pid"), e.get("rank")
            if kind == "header":
                host = e.get("hostname")
                file_hosts[pid] = host
                self.host_of_pid.setdefault(pid, host)
                schema = str(e.get("schema", "?"))
                stats.schemas[schema] = stats.schemas.get(schema, 0) + 1
                stats.headers += 1
            if sid is None or sid[1] != pid or sid[2] != rank:
                host = file_hosts.get(pid, self.host_of_pid.get(pid))
                sid = (host, pid, rank)
                stream = self.streams.get(sid)
                if stream is None:
                    prev = file_streams.get(pid)
                    if prev is not None and kind != "header" and prev.host == host and prev.last_kind != "shutdown":
                        # the same process, its rank known only now (a process group that came up
                        # after enable()): one process, not a "stopped" one beside it
                        del self.streams[(prev.host, prev.pid, prev.rank)]
                        prev.rank = rank
                        stream = self.streams[sid] = prev
                    else:
                        stream = self.streams[sid] = Stream(sid, self.last)
                file_streams[pid] = stream
                if not stream.files or stream.files[-1] != path:
                    stream.files.append(path)
            assert stream is not None
            seq = e.get("seq")
            if seq is not None:
                span = stream.spans.get(base)
                if span is None:
                    span = stream.spans[base] = SeqSpan()
                if e.get("rotated") is True:  # a header copied at the top of a rotated part: not a line of its own
                    span.rotated = True
                else:
                    span.add(seq, opens=kind == "header")
                    span.rotated = span.rotated or rotated_part
            try:
                self._event(stream, kind, e)
            except Exception:  # a combination of fields no check foresaw: one corrupt line, never a traceback
                self.errors += 1
                stats.events -= 1
                stats.bad(lineno)
        if not stats.known:
            reason = "empty" if not stats.lines else ("no fusionguard events" if stats.events else "not JSON lines")
            self.ignored.append({"path": path, "reason": reason})
        elif not stats.headers:
            stats.schemas["none"] = 0

    def _mask(self, kind: str, e: dict) -> None:
        m = self.masks
        if e.get("path") == "compiled":
            m["compiled"] += 1
            return
        if e.get("action") == "allow":
            return
        n = e.get("count") if kind == "mask_builds" else 1
        n = n if isinstance(n, int) and not isinstance(n, bool) else 0
        est = e.get("estimated_bytes" if kind == "mask_build" else "estimated_bytes_max")
        if e.get("action") == "log":  # below mask_limit and fits: logged, not a finding (#32)
            m["small"] += n
            if isinstance(est, int) and not isinstance(est, bool) and (m["small_estimated_max"] is None or est > m["small_estimated_max"]):
                m["small_estimated_max"] = est
            return
        m["dense"] += n
        if e.get("action") == "raise":
            m["blocked"] += 1
        if isinstance(est, int) and not isinstance(est, bool) and (m["estimated_max"] is None or est > m["estimated_max"]):
            m["estimated_max"] = est
        if m["call_site"] is None and isinstance(e.get("call_site"), dict):
            m["call_site"] = e["call_site"]

    def _event(self, s: Stream, kind: str, e: dict) -> None:
        # The hot loop (every line of a 1 GB log): plain comparisons, no per-event allocations
        # beyond the parsed dict; the deque keeps references, compacted only when shown.
        s.events += 1
        kinds = self.kinds
        kinds[kind] = kinds.get(kind, 0) + 1
        ts = e.get("ts")
        if ts is not None:  # a finite number (read_events checked it)
            if s.first_ts is None:
                s.first_ts = s.last_ts = ts
            elif ts > s.last_ts:
                s.last_ts = ts
            elif ts < s.first_ts:
                s.first_ts = ts
        seq = e.get("seq")
        if seq is None or s.last_seq is None or seq >= s.last_seq:
            if seq is not None:
                s.last_seq = seq
            s.last_kind = kind
        if kind not in KNOWN_EVENTS:
            self.unknown[kind] = self.unknown.get(kind, 0) + 1
            return
        first = self.firsts.get(kind)
        if first is None or (ts is not None and (first.get("ts") is None or ts < first["ts"])):
            self.firsts[kind] = {**compact(e), "rank": s.rank, "pid": s.pid, "host": s.host}
        if kind == "mask_build" or kind == "mask_builds":
            self._mask(kind, e)
        if kind == "crash":
            s.crash_count += 1
            if len(s.crashes) < 3:
                s.crashes.append({"event": _crash_fields(e), "before": [compact(x) for x in s.recent]})
        s.recent.append(e)
        if kind == "layer_memory":
            key = self._key(e)
            ks = self.keys[key]
            if not e.get("recompute") and e.get("path") == "fused":
                s.count(key).layer_calls += 1
            a, p = e.get("alloc_delta"), e.get("peak_delta")
            if a is not None:
                ks.alloc.add(a)
            if p is not None:
                ks.peak.add(p)
            return
        if kind == "flex_call" or kind == "dense_calls":
            key = self._key(e)
            c = s.count(key)
            ks = self.keys[key]
            # dense_calls: the sampled repeats of one dense call (counted, not logged one by one)
            n = (e.get("count") or 0) if kind == "dense_calls" else 1
            path = e.get("path", "dense")
            if path == "rescued":
                c.rescued += 1  # rescue ran it through a fused compile
            elif path == "dense" or path is None:
                sb = e.get("scores_bytes" if kind == "flex_call" else "scores_bytes_max")
                if e.get("action") == "allow" or e.get("allowed") is True:
                    c.allowed += n
                    return
                c.dense += n
                cause = e.get("cause")
                cause = "unknown" if cause is None else cause
                c.causes[cause] = c.causes.get(cause, 0) + n
                if e.get("action") == "raise":
                    c.blocked += n
                    if e.get("blocked_by") == "oom":
                        c.oom_blocked += n
                        self._oom(e, n)
                pb = _count(e.get("predicted_bytes" if kind == "flex_call" else "predicted_bytes_max"))
                if pb is not None and (ks.predicted_max is None or pb > ks.predicted_max):
                    ks.predicted_max = pb
                if sb is not None and (ks.scores_max is None or sb > ks.scores_max):
                    ks.scores_max = sb
                fd = ks.first_dense
                if fd is None or (ts is not None and (fd["ts"] is None or ts < fd["ts"])):
                    ks.first_dense = {
                        "ts": ts,
                        "rank": s.rank,
                        "pid": s.pid,
                        "host": s.host,
                        "seq": seq,
                        "cause": e.get("cause"),
                        "call_site": e.get("call_site"),
                        "scores_bytes": sb,
                    }
        elif kind == "flex_compile":
            key = self._key(e)
            s.count(key).compiles += 1
            t = e.get("template")
            if t is not None:
                ks = self.keys[key]
                ks.templates[t] = ks.templates.get(t, 0) + 1
        elif kind == "flex_run":
            n = e.get("flex_calls")
            self._runs(s, e, 1 if n is None else n)
        elif kind == "flex_inlined":
            s.count(self._key(e)).inlined += 1
        elif kind == "fused_calls":
            n = e.get("count") or 0
            if e.get("of") == "flex_run":
                flex = e.get("flex_calls")
                self._runs(s, e, n if flex is None else flex)
                return
            key = self._key(e)
            s.count(key).layer_calls += n
            ks = self.keys[key]
            for name, res in (("alloc_delta", ks.alloc), ("peak_delta", ks.peak)):
                mx, last = e.get(f"{name}_max"), e.get(f"{name}_last")
                if mx is not None:
                    res.note_max(mx)
                if last is not None:
                    res.add(last)
        elif kind == "summary":
            rows = e.get("rows")
            if rows is not None:
                s.summary_rows = rows[:MAX_KEYS]
        elif kind == "recompile_pressure":
            self._pressure(e)
        elif kind == "no_flex_calls":
            self._no_flex(e)
        elif kind == "shutdown":
            s.last_shutdown = str(e.get("reason"))
        elif kind == "header":
            s.header = {
                k: e.get(k)
                for k in (
                    "schema",
                    "fusionguard",
                    "torch",
                    "triton",
                    "python",
                    "hostname",
                    "cuda",
                    "world_size",
                    "local_rank",
                    "crash_file",
                    "forked_from",
                )
            }

    def _pressure(self, e: dict) -> None:
        """A frame near Dynamo's recompile limit: one entry per frame (file, line, function),
        its highest compile count across processes."""
        key = (_text(e.get("file")), _count(e.get("line")), _text(e.get("function")))
        self._distinct("pressure", key)
        old = self.pressure.get(key)
        if old is None and len(self.pressure) >= MAX_KEYS:
            return
        compiles = _count(e.get("compiles"))
        if old is not None and (old["compiles"] or 0) >= (compiles or 0):
            old["processes"] += 1
            return
        self.pressure[key] = {
            "function": key[2],
            "file": key[0],
            "line": key[1],
            "compiles": compiles,
            "limit": _count(e.get("limit")),
            "varies": _text(e.get("varies")),
            "reason": _text(e.get("reason")),
            "fix": _text(e.get("fix")),
            "processes": (old["processes"] + 1) if old else 1,
        }

    def _distinct(self, what: str, key: Tuple[Any, ...]) -> None:
        """Count ``key`` among ``what``'s distinct keys, up to ``MAX_DISTINCT`` (then: full)."""
        seen = self.distinct[what]
        h = hash(key)
        if h not in seen:
            if len(seen) >= MAX_DISTINCT:
                self.distinct_full.add(what)
            else:
                seen.add(h)

    def _oom(self, e: dict, n: int) -> None:
        """A dense call the oom mode blocked: counted; the largest need kept with what the
        device could still give at that call."""
        o = self.oom
        o["blocked"] += n
        needed = _count(e.get("predicted_bytes"))
        if needed is not None and (o["needed_bytes"] is None or needed > o["needed_bytes"]):
            o.update(
                needed_bytes=needed,
                free_bytes=_count(e.get("free_bytes")),
                layer=_text(e.get("layer")),
                phase=_text(e.get("phase")),
                call_site=e.get("call_site") if isinstance(e.get("call_site"), dict) else None,
            )

    def _no_flex(self, e: dict) -> None:
        """A watched model whose forward made no FlexAttention call: one entry per model class
        and attention implementation."""
        key = (_text(e.get("model")), _text(e.get("attn_implementation")))
        self._distinct("no_flex", key)
        old = self.no_flex.get(key)
        if old is not None:
            old["processes"] += 1
        elif len(self.no_flex) < MAX_KEYS:
            self.no_flex[key] = {"model": key[0], "attn_implementation": key[1], "processes": 1}

    def _runs(self, s: Stream, e: dict, n: int) -> None:
        """Fused calls of graph runs, to their layer. A graph holding several layers' calls names
        them in ``layers``: one call each when there are as many calls as distinct names;
        otherwise (and in counters, which name no layers) the calls stay unattributed (NO_LAYER)
        until the process's summary rows split them."""
        layers = e.get("layers")
        if e.get("layer") is None and layers and n == len(layers) and len(set(layers)) == n:
            phase = str(e.get("phase"))
            for name in layers:
                s.count(self._named(name, phase)).runs += 1
            return
        s.count(self._key(e)).runs += n

    # -- the fused calls of each process, and its summary rows -----------------------------------
    def _settle(self) -> None:
        """Per process: each key's fused calls from its events; the process's last ``summary``
        rows then name the layers of calls that the events could not attribute (a graph holding
        several layers' calls), without adding a call: per phase, the named rows take the larger
        of events and summary, and NO_LAYER keeps only what is left of the events' total.
        Rows gathered from a rank whose own log is not in the input become a stream of their own
        ("summary only")."""
        real_ranks = {s.rank for s in self.streams.values()}
        synthetic: Dict[Any, Stream] = {}
        for s in list(self.streams.values()):
            s.trusted_summary = bool(s.summary_rows) and _rotation_explains(s)
            for c in s.counts.values():
                c.fused = c.event_fused()
            for row in s.summary_rows or ():
                row_rank = row.get("rank", s.rank)
                if row_rank == s.rank or row_rank is None:
                    target = s
                elif row_rank in real_ranks:
                    continue  # that rank's own log is here
                else:  # gathered on this rank from a rank whose log we do not have
                    found = synthetic.get(row_rank)
                    if found is None:
                        found = synthetic[row_rank] = Stream((s.host, None, row_rank), self.last)
                        found.synthetic = True
                    target = found
                key = self._key(row)
                c = target.count(key)
                ks = self.keys[key]
                fused = row.get("fused") or 0
                c.summary_fused = max(c.summary_fused or 0, fused)
                if target.synthetic or target.trusted_summary:  # the row is all there is, or its own final count
                    c.fused = max(c.fused, fused)
                    c.dense = max(c.dense, row.get("dense") or 0)
                    for k, v in (row.get("causes") or {}).items():
                        if v is not None and v > c.causes.get(k, 0):
                            c.causes[k] = v
                    sb = row.get("scores_bytes")
                    if sb is not None and c.dense and (ks.scores_max is None or sb > ks.scores_max):
                        ks.scores_max = sb
                for name, res in (("alloc_delta", ks.alloc), ("peak_delta", ks.peak)):
                    mx, last = row.get(f"{name}_max"), row.get(f"{name}_last")
                    if mx is not None:
                        res.note_max(mx)
                    if last is not None and not res.sample:
                        res.add(last)
            if not s.synthetic and s.summary_rows and not s.trusted_summary:
                self._split_by_summary(s)
        for r, st in synthetic.items():
            self.streams[("(summary)", None, r)] = st

    def _split_by_summary(self, s: Stream) -> None:
        """Name the layers of a process's unattributed fused calls (NO_LAYER: counters of graphs
        holding several layers' calls) from its summary rows, never adding a call: a named layer
        takes what its row counts beyond its own events, out of the unattributed calls. When the
        rows count more than the unattributed calls can cover (rows of an earlier log of the same
        process), nothing is split and a warning says so."""
        phases: Dict[str, List[Tuple[Tuple[str, str], LayerTally]]] = {}
        for key, c in s.counts.items():
            phases.setdefault(key[1], []).append((key, c))
        for phase, items in phases.items():
            loose = [c for key, c in items if key[0] == NO_LAYER]
            unnamed = sum(c.fused for c in loose)
            deficits = [(c, (c.summary_fused or 0) - c.fused) for key, c in items if key[0] != NO_LAYER]
            deficits = [(c, d) for c, d in deficits if d > 0]
            want = sum(d for _, d in deficits)
            if not want or not unnamed:
                continue
            if want > unnamed:
                self.notes.append(
                    f"pid {s.pid}: summary rows count {want:,} more {phase} fused calls than its log leaves unnamed "
                    f"({unnamed:,}); those stay under {NO_LAYER!r} (rows of an earlier log of the same process?)"
                )
                continue
            for c, d in deficits:
                c.fused += d
            left = unnamed - want
            for c in loose:  # what no row claims stays unnamed
                c.fused, left = min(c.fused, left), left - min(c.fused, left)

    def finish(self) -> None:
        """After the last file: the run's time span, and each process's fused calls settled."""
        firsts = [st.first_ts for st in self.streams.values() if st.first_ts is not None]
        lasts = [st.last_ts for st in self.streams.values() if st.last_ts is not None]
        self.first_ts = min(firsts) if firsts else None
        self.last_ts = max(lasts) if lasts else None
        self._settle()


def _rotation_explains(s: Stream) -> bool:
    """True when every line missing from ``s`` (a gap in its seq numbers) was in a rotated part
    of its one log path that is gone: its summary rows, written at its end, then count exactly
    the calls of that path (a new log path counts from zero), the pruned ones too."""
    if len(s.spans) != 1:
        return False
    (span,) = s.spans.values()
    return span.rotated and span.before > 0 and span.between == 0


def _crash_fields(e: dict) -> Dict[str, Any]:
    keys = ("seq", "ts", "thread", "exc_type", "message", "where", "diagnosis", "last_flex", "cuda", "frames")
    out: Dict[str, Any] = {k: e.get(k) for k in keys if k in e}
    if isinstance(out.get("message"), str):
        out["message"] = _short(out["message"], 1000)
    if isinstance(out.get("frames"), list):
        out["frames"] = [_short(f, 300) for f in out["frames"][-8:]]
    return out
