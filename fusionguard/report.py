"""``fusionguard report``: read fusionguard JSON-lines logs and say what ran dense, where, why, how
much memory it took and how the run ended.

Reading is streaming and bounded: one line at a time (a line longer than ``MAX_LINE`` is skipped
without being held), per (layer, phase) a fixed-size reservoir of memory figures (exact median
up to ``RESERVOIR`` samples, exact max always), per process the last ``last`` events in a deque,
and a cap on distinct (layer, phase) keys. A 1 GB log therefore needs tens of MB, whatever its
length. Nothing here imports torch.

Input rules: a file or a directory (every ``*.jsonl`` inside, recursively, with its rotated
parts ``*.jsonl.N`` read oldest first); a torn last line, corrupt lines and lines that are not
event objects are counted and reported, never fatal; unknown event kinds are counted and
otherwise ignored; every header's ``schema`` is reported (newer than ``SUPPORTED_SCHEMA``: a
warning, known fields are still read).

Events are grouped by *process*: (hostname from the header, pid, rank). A process whose log
contains a ``crash`` event crashed; one whose last event is not a ``shutdown`` stopped without
one (SIGKILL, the OOM killer, a node failure, or still running).
"""

from __future__ import annotations

import collections
import csv
import io
import json
import math
import os
import random
import re
import time
from typing import Any, Deque, Dict, Iterable, Iterator, List, Optional, Tuple

SUPPORTED_SCHEMA = 1
REPORT_VERSION = 1
MAX_LINE = 16 * 1024 * 1024
RESERVOIR = 2048
MAX_CRASHES_SHOWN = 4  # crash/stop sections in the text report (all in --format json)
MAX_KEYS = 10_000
NO_LAYER = "(no layer)"
OTHER_LAYERS = "(other layers)"
KNOWN_EVENTS = frozenset(
    {
        "header", "flex_call", "flex_compile", "flex_inlined", "recompile_limit", "compile_error",
        "graph_break", "internal_error", "shutdown", "layer_memory", "fused_calls", "summary", "crash",
        "flex_run", "rescue_failed", "dense_calls", "watch_traced", "compiled_before_enable",
    }
)
_DECODER = json.JSONDecoder()
_ROTATED = re.compile(r"^(?P<base>.+\.jsonl)(?:\.(?P<n>\d+))?$")
_PHASE_ORDER = {"forward": 0, "backward": 1}


class ReportError(Exception):
    """Bad input that leaves nothing to report on (exit status 2)."""


# -- small helpers ---------------------------------------------------------------------------------


class Reservoir:
    """Uniform sample of at most ``cap`` values and the exact max.

    Algorithm L (Li, 1994): once full, it draws how many values to skip before the next
    replacement, so most values cost two comparisons; fixed seed, reproducible medians."""

    __slots__ = ("n", "max", "sample", "cap", "_rng", "_w", "_next")

    def __init__(self, cap: int = RESERVOIR) -> None:
        self.n = 0
        self.max: Optional[float] = None
        self.sample: List[float] = []
        self.cap = cap
        self._rng: Optional[random.Random] = None
        self._w = 1.0
        self._next = 0

    def add(self, x: float) -> None:
        n = self.n = self.n + 1
        if self.max is None or x > self.max:
            self.max = x
        if n <= self.cap:
            self.sample.append(x)
            if n == self.cap:
                self._rng = random.Random(0)
                self._w = math.exp(math.log(self._random()) / self.cap)
                self._skip()
            return
        if n == self._next:
            self.sample[self._rng.randrange(self.cap)] = x  # type: ignore[union-attr]
            self._w *= math.exp(math.log(self._random()) / self.cap)
            self._skip()

    def _random(self) -> float:
        r = 0.0
        while r == 0.0:
            r = self._rng.random()  # type: ignore[union-attr]
        return r

    def _skip(self) -> None:
        w = self._w
        gap = math.floor(math.log(self._random()) / math.log1p(-w)) if w < 1.0 else 0
        self._next = self.n + gap + 1

    def note_max(self, x: float) -> None:
        if self.max is None or x > self.max:
            self.max = x

    def median(self) -> Optional[float]:
        if not self.sample:
            return None
        s = sorted(self.sample)
        mid = len(s) // 2
        value = s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
        return int(value) if float(value).is_integer() else value


def _num(x: Any) -> Optional[float]:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return x


def _int(x: Any) -> Optional[int]:
    return int(x) if isinstance(x, int) and not isinstance(x, bool) else None


def _short(x: Any, n: int = 200) -> Any:
    if isinstance(x, str) and len(x) > n:
        return x[: n - 3] + "..."
    return x


def human_bytes(n: Optional[float], signed: bool = False) -> str:
    if n is None:
        return "-"
    sign = "-" if n < 0 else ("+" if signed and n > 0 else "")
    value = abs(float(n))
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            body = f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
            return sign + body
        value /= 1000
    return f"{n} B"


def site_text(site: Any) -> Optional[str]:
    if not isinstance(site, dict) or not site.get("file"):
        return None
    return f"{site.get('file')}:{site.get('line')} in {site.get('function')}"


def natural_key(text: str) -> Tuple:
    if text in (NO_LAYER, OTHER_LAYERS):
        return (1, text)
    return (0,) + tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))


def rank_ranges(ranks: Iterable[Any]) -> str:
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
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) + f".{int((ts % 1) * 1000):03d} UTC"


def fmt_duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    if seconds < 60:
        return f"{seconds:.1f}s"
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


# -- input files -----------------------------------------------------------------------------------


def find_logs(paths: Iterable[str], notes: Optional[List[str]] = None) -> List[str]:
    """Files to read, in order; directories give every ``*.jsonl`` (and rotated ``*.jsonl.N``,
    oldest first) below them. A file is read alone; its rotated parts, if any, are mentioned in
    ``notes``. Raises ReportError for a missing path or a directory without logs."""
    out: List[str] = []
    seen = set()
    for raw in paths:
        path = os.fspath(raw)
        if os.path.isdir(path):
            found: List[Tuple[str, int, str]] = []
            for root, dirs, files in os.walk(path):
                dirs.sort()
                for name in files:
                    m = _ROTATED.match(name)
                    if m:
                        n = int(m.group("n")) if m.group("n") else 0
                        found.append((os.path.join(root, m.group("base")), -n, os.path.join(root, name)))
            if not found:
                raise ReportError(f"no fusionguard logs (*.jsonl) in directory {path}")
            files_in_order = [f for _, _, f in sorted(found)]
        elif os.path.isfile(path):
            files_in_order = [path]
            if notes is not None and path.endswith(".jsonl") and os.path.exists(path + ".1"):
                notes.append(
                    f"{os.path.basename(path)} has rotated parts ({os.path.basename(path)}.1 ...) that were not read: "
                    "pass its directory to include them"
                )
        elif os.path.exists(path):
            raise ReportError(f"not a file or directory: {path}")
        else:
            raise ReportError(f"no such file or directory: {path}")
        for f in files_in_order:
            real = os.path.realpath(f)
            if real not in seen:
                seen.add(real)
                out.append(f)
    return out


class FileStats:
    __slots__ = ("path", "bytes", "lines", "events", "corrupt", "corrupt_lines", "torn_last_line", "oversized", "schemas", "headers")

    def __init__(self, path: str) -> None:
        self.path = path
        self.bytes = 0
        self.lines = 0
        self.events = 0
        self.corrupt = 0
        self.corrupt_lines: List[int] = []
        self.torn_last_line = False
        self.oversized = 0
        self.schemas: Dict[str, int] = {}
        self.headers = 0

    def bad(self, lineno: int) -> None:
        self.corrupt += 1
        if len(self.corrupt_lines) < 5:
            self.corrupt_lines.append(lineno)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "path": self.path,
            "bytes": self.bytes,
            "lines": self.lines,
            "events": self.events,
            "corrupt_lines": self.corrupt,
            "first_corrupt_lines": list(self.corrupt_lines),
            "torn_last_line": self.torn_last_line,
            "oversized_lines": self.oversized,
            "schemas": dict(self.schemas),
        }


def read_events(path: str, stats: FileStats) -> Iterator[dict]:
    """Events of one file, one line at a time; bad lines are counted in ``stats``."""
    max_line = MAX_LINE
    decode = _DECODER.decode

    def loads(raw: bytes) -> Any:
        return decode(raw.decode("utf-8"))

    with open(path, "rb") as fh:
        lineno = 0
        while True:
            line = fh.readline(max_line)
            if not line:
                break
            lineno += 1
            stats.lines += 1
            stats.bytes += len(line)
            if not line.endswith(b"\n"):
                if len(line) >= max_line:  # oversized: skip to the next newline, holding nothing
                    while True:
                        rest = fh.readline(max_line)
                        stats.bytes += len(rest)
                        if not rest or rest.endswith(b"\n"):
                            break
                    stats.oversized += 1
                    stats.bad(lineno)
                    continue
                try:  # last line without a newline: an event, or a line torn by a crash
                    obj = loads(line)
                except ValueError:
                    if line.strip():
                        stats.torn_last_line = True
                    continue
            else:
                if not line.strip():
                    continue
                try:
                    obj = loads(line)
                except ValueError:  # includes UnicodeDecodeError
                    stats.bad(lineno)
                    continue
            if not isinstance(obj, dict) or not isinstance(obj.get("event"), str):
                stats.bad(lineno)
                continue
            stats.events += 1
            yield obj


# -- aggregation -----------------------------------------------------------------------------------


class Counts:
    __slots__ = ("dense", "fused", "calls", "runs", "compiles", "blocked", "inlined", "causes")

    def __init__(self) -> None:
        self.dense = 0
        self.fused = 0  # explicit fused per-call records (layer_memory, rescued flex_call)
        self.calls = 0  # per-call records (layer_memory / fused_calls), recomputes excluded
        self.runs = 0  # fused FlexAttention calls executed by compiled graphs (flex_run)
        self.compiles = 0
        self.blocked = 0
        self.inlined = 0
        self.causes: Dict[str, int] = {}

    def fused_calls(self) -> int:
        # calls of a FlexAttention layer that ran no dense kernel ran the fused one; compiled
        # graphs count their own runs (the same calls, seen from the other side: never added)
        return max(self.fused, self.calls - self.dense, self.runs)


class KeyStats:
    """Across all processes, per (layer, phase): memory and the first dense call."""

    __slots__ = ("alloc", "peak", "scores_max", "first_dense", "templates")

    def __init__(self) -> None:
        self.alloc = Reservoir()
        self.peak = Reservoir()
        self.scores_max: Optional[int] = None
        self.first_dense: Optional[Dict[str, Any]] = None
        self.templates: Dict[str, int] = {}


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
        self.counts: Dict[Tuple[str, str], Counts] = {}
        self.summary_rows: Optional[List[dict]] = None
        self.header: Dict[str, Any] = {}
        self.files: List[str] = []
        self.synthetic = False

    def count(self, key: Tuple[str, str]) -> Counts:
        c = self.counts.get(key)
        if c is None:
            c = self.counts[key] = Counts()
        return c


_COMPACT = ("seq", "ts", "event", "level", "layer", "phase", "path", "cause", "thread")
_EXTRA = {
    "flex_call": ("action", "scores_bytes"),
    "layer_memory": ("alloc_delta", "peak_delta", "recompute"),
    "fused_calls": ("count", "total"),
    "dense_calls": ("count", "total", "action"),
    "shutdown": ("reason",),
    "crash": ("exc_type", "diagnosis", "where"),
    "internal_error": ("where", "error"),
    "recompile_limit": ("function", "reason"),
    "graph_break": ("function", "reason"),
    "compile_error": ("function", "error"),
    "flex_compile": ("template", "source"),
}


def compact(e: dict) -> Dict[str, Any]:
    out = {k: _short(e[k]) for k in _COMPACT if k in e and e[k] is not None}
    for k in _EXTRA.get(e.get("event"), ()):  # type: ignore[arg-type]
        if e.get(k) is not None:
            out[k] = _short(e[k])
    return out


class Aggregator:
    def __init__(self, last: int = 10) -> None:
        self.last = last
        self.files: List[FileStats] = []
        self.streams: Dict[Tuple[Any, Any, Any], Stream] = {}
        self.keys: Dict[Tuple[str, str], KeyStats] = {}
        self.kinds: Dict[str, int] = {}
        self.unknown: Dict[str, int] = {}
        self.first_ts: Optional[float] = None
        self.last_ts: Optional[float] = None
        self.host_of_pid: Dict[Any, Any] = {}
        self.key_overflow = 0
        self.notes: List[str] = []

    # keys
    def _key(self, e: dict) -> Tuple[str, str]:
        layer = e.get("layer")
        layer = NO_LAYER if layer is None else str(layer)
        phase = e.get("phase")
        phase = "?" if phase is None else str(phase)
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
        file_hosts: Dict[Any, Any] = {}
        stream: Optional[Stream] = None
        sid: Any = None
        for e in read_events(path, stats):
            kind = e["event"]
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
                    stream = self.streams[sid] = Stream(sid, self.last)
                if not stream.files or stream.files[-1] != path:
                    stream.files.append(path)
            assert stream is not None
            self._event(stream, kind, e)
        if not stats.headers and stats.events:
            stats.schemas["none"] = 0

    def _event(self, s: Stream, kind: str, e: dict) -> None:
        # The hot loop (every line of a 1 GB log): plain comparisons, no per-event allocations
        # beyond the parsed dict; the deque keeps references, compacted only when shown.
        s.events += 1
        kinds = self.kinds
        kinds[kind] = kinds.get(kind, 0) + 1
        ts = e.get("ts")
        if ts.__class__ is float or ts.__class__ is int:
            if s.first_ts is None:
                s.first_ts = s.last_ts = ts
            elif ts > s.last_ts:  # type: ignore[operator]
                s.last_ts = ts
            elif ts < s.first_ts:
                s.first_ts = ts
        else:
            ts = None
        seq = e.get("seq")
        if seq.__class__ is not int:
            seq = None
        if seq is None or s.last_seq is None or seq >= s.last_seq:
            if seq is not None:
                s.last_seq = seq
            s.last_kind = kind
        if kind not in KNOWN_EVENTS:
            self.unknown[kind] = self.unknown.get(kind, 0) + 1
            return
        if kind == "crash":
            s.crash_count += 1
            if len(s.crashes) < 3:
                s.crashes.append({"event": _crash_fields(e), "before": [compact(x) for x in s.recent]})
        s.recent.append(e)
        if kind == "layer_memory":
            key = self._key(e)
            c = s.count(key)
            ks = self.keys[key]
            path = e.get("path")
            if not e.get("recompute"):
                c.calls += 1
                if path == "fused":
                    c.fused += 1
            a, p = _num(e.get("alloc_delta")), _num(e.get("peak_delta"))
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
            n = (_int(e.get("count")) or 0) if kind == "dense_calls" else 1
            if e.get("path") == "rescued":
                c.fused += 1  # rescue ran it through a fused compile
            elif e.get("path", "dense") == "dense":
                c.dense += n
                cause = e.get("cause")
                cause = "unknown" if cause is None else str(cause)
                c.causes[cause] = c.causes.get(cause, 0) + n
                if e.get("action") == "raise":
                    c.blocked += n
                sb = _int(e.get("scores_bytes" if kind == "flex_call" else "scores_bytes_max"))
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
                        "call_site": e.get("call_site") if isinstance(e.get("call_site"), dict) else None,
                        "scores_bytes": sb,
                    }
        elif kind == "flex_compile":
            key = self._key(e)
            s.count(key).compiles += 1
            t = e.get("template")
            if t is not None:
                ks = self.keys[key]
                ks.templates[str(t)] = ks.templates.get(str(t), 0) + 1
        elif kind == "flex_run":
            n = _int(e.get("flex_calls"))
            s.count(self._key(e)).runs += n if n is not None else 1
        elif kind == "flex_inlined":
            s.count(self._key(e)).inlined += 1
        elif kind == "fused_calls":
            key = self._key(e)
            c = s.count(key)
            n = _int(e.get("count")) or 0
            if e.get("of") == "flex_run":
                flex = _int(e.get("flex_calls"))
                c.runs += flex if flex is not None else n
                return
            c.calls += n
            c.fused += n
            ks = self.keys[key]
            for name, res in (("alloc_delta", ks.alloc), ("peak_delta", ks.peak)):
                mx, last = _num(e.get(f"{name}_max")), _num(e.get(f"{name}_last"))
                if mx is not None:
                    res.note_max(mx)
                if last is not None:
                    res.add(last)
        elif kind == "summary":
            rows = e.get("rows")
            if isinstance(rows, list):
                s.summary_rows = [r for r in rows[: MAX_KEYS] if isinstance(r, dict)]
        elif kind == "shutdown":
            s.last_shutdown = str(e.get("reason"))
        elif kind == "header":
            s.header = {k: e.get(k) for k in ("schema", "fusionguard", "torch", "triton", "python", "hostname", "cuda", "world_size", "local_rank")}

    # -- summary rows: what the process itself counted (covers sampled-out events) --------------
    def _merge_summaries(self) -> None:
        real_ranks = {s.rank for s in self.streams.values()}
        synthetic: Dict[Any, Stream] = {}
        for s in list(self.streams.values()):
            if not s.summary_rows:
                continue
            for row in s.summary_rows:
                row_rank = row.get("rank", s.rank)
                if row_rank == s.rank or row_rank is None:
                    target = s
                elif row_rank in real_ranks:
                    continue  # that rank's own log is here
                else:  # gathered on this rank from a rank whose log we do not have
                    target = synthetic.get(row_rank)
                    if target is None:
                        target = synthetic[row_rank] = Stream((s.host, None, row_rank), self.last)
                        target.synthetic = True
                key = self._key(row)
                c = target.count(key)
                ks = self.keys[key]
                dense = _int(row.get("dense")) or 0
                fused = _int(row.get("fused")) or 0
                calls = _int(row.get("calls")) or 0
                c.dense = max(c.dense, dense)
                c.fused = max(c.fused, fused)
                c.calls = max(c.calls, calls)
                causes = row.get("causes")
                if isinstance(causes, dict):
                    for k, v in causes.items():
                        if isinstance(v, int):
                            c.causes[str(k)] = max(c.causes.get(str(k), 0), v)
                for name, res in (("alloc_delta", ks.alloc), ("peak_delta", ks.peak)):
                    mx, last = _num(row.get(f"{name}_max")), _num(row.get(f"{name}_last"))
                    if mx is not None:
                        res.note_max(mx)
                    if last is not None and not res.sample:
                        res.add(last)
                sb = _int(row.get("scores_bytes"))
                if sb is not None and dense and (ks.scores_max is None or sb > ks.scores_max):
                    ks.scores_max = sb
        for r, st in synthetic.items():
            self.streams[("(summary)", None, r)] = st

    def finish(self) -> Dict[str, Any]:
        firsts = [st.first_ts for st in self.streams.values() if st.first_ts is not None]
        lasts = [st.last_ts for st in self.streams.values() if st.last_ts is not None]
        self.first_ts = min(firsts) if firsts else None
        self.last_ts = max(lasts) if lasts else None
        self._merge_summaries()
        return build_report(self)


def _crash_fields(e: dict) -> Dict[str, Any]:
    keys = ("seq", "ts", "thread", "exc_type", "message", "where", "diagnosis", "last_flex", "cuda", "frames")
    out = {k: e.get(k) for k in keys if k in e}
    if isinstance(out.get("message"), str):
        out["message"] = _short(out["message"], 1000)
    if isinstance(out.get("frames"), list):
        out["frames"] = [_short(f, 300) for f in out["frames"][-8:]]
    return out


# -- the report (a plain dict: this is also --format json) ------------------------------------------


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
    streams = [s for s in agg.streams.values()]
    ranks = _sorted_ranks({s.rank for s in streams})
    multi_rank = len(ranks) > 1

    # per key totals over processes, and which ranks went which way
    rows: List[Dict[str, Any]] = []
    per_rank: Dict[Any, Dict[Tuple[str, str], List[int]]] = {}
    for key in sorted(agg.keys, key=lambda k: (natural_key(k[0]), _PHASE_ORDER.get(k[1], 9), k[1])):
        total = Counts()
        dense_ranks, fused_ranks = set(), set()
        per_call_records = False
        for s in streams:
            c = s.counts.get(key)
            if c is None:
                continue
            total.dense += c.dense
            total.calls += c.calls
            total.compiles += c.compiles
            total.blocked += c.blocked
            total.inlined += c.inlined
            fc = c.fused_calls()
            total.fused += fc
            per_call_records = per_call_records or c.calls > 0 or c.fused > 0 or c.runs > 0
            for k, v in c.causes.items():
                total.causes[k] = total.causes.get(k, 0) + v
            pr = per_rank.setdefault(s.rank, {}).setdefault(key, [0, 0])
            pr[0] += c.dense
            pr[1] += fc + c.compiles
        for r, keys in per_rank.items():
            d, f = keys.get(key, (0, 0))
            if d:
                dense_ranks.add(r)
            elif f:
                fused_ranks.add(r)
        ks = agg.keys[key]
        fd = ks.first_dense
        rows.append(
            {
                "layer": key[0],
                "phase": key[1],
                "dense": total.dense,
                "fused": total.fused if per_call_records else total.compiles,
                "fused_calls": total.fused if per_call_records else None,
                "compiles": total.compiles,
                "blocked": total.blocked,
                "inlined": total.inlined,
                "causes": dict(sorted(total.causes.items(), key=lambda kv: (-kv[1], kv[0]))),
                "alloc_delta_median": ks.alloc.median(),
                "alloc_delta_max": ks.alloc.max,
                "peak_delta_median": ks.peak.median(),
                "peak_delta_max": ks.peak.max,
                "memory_samples": max(ks.alloc.n, ks.peak.n),
                "scores_bytes_max": ks.scores_max,
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
            dense = [
                {"layer": k[0], "phase": k[1], "dense": v[0]}
                for k, v in sorted(per_rank.get(r, {}).items(), key=lambda kv: (natural_key(kv[0][0]), _PHASE_ORDER.get(kv[0][1], 9)))
                if v[0]
            ]
            rank_rows.append({"rank": r, "dense_calls": sum(d["dense"] for d in dense), "dense": dense})
        for row in rows:
            if row["dense_ranks"] and row["fused_ranks"]:
                disagreements.append({"layer": row["layer"], "phase": row["phase"], "dense_ranks": row["dense_ranks"], "fused_ranks": row["fused_ranks"]})

    # runs: versions, devices, hosts
    versions: Dict[Tuple, int] = {}
    devices: Dict[str, List[str]] = {}
    world = None
    for s in streams:
        h = s.header
        if h:
            v = (h.get("fusionguard"), h.get("torch"), h.get("triton"), h.get("python"))
            versions[v] = versions.get(v, 0) + 1
            cuda = h.get("cuda") if isinstance(h.get("cuda"), dict) else {}
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
    for f in agg.files:
        for k in f.schemas:
            schemas[k] = schemas.get(k, 0) + 1
    warnings = list(agg.notes)
    numeric = [int(k) for k in schemas if k.isdigit()]
    if len([k for k in schemas if k != "none"]) > 1:
        warnings.append("mixed schema versions: " + ", ".join(f"{k} ({n} file{'s' if n > 1 else ''})" for k, n in sorted(schemas.items())))
    if numeric and max(numeric) > SUPPORTED_SCHEMA:
        warnings.append(f"schema {max(numeric)} is newer than this report understands ({SUPPORTED_SCHEMA}): known fields are read, others ignored")
    corrupt = sum(f.corrupt for f in agg.files)
    torn = [f.path for f in agg.files if f.torn_last_line]
    if corrupt:
        where = ", ".join(f"{os.path.basename(f.path)}:{ln}" for f in agg.files for ln in f.corrupt_lines)
        warnings.append(f"{corrupt} corrupt line{'s' if corrupt > 1 else ''} skipped ({where}{', ...' if corrupt > 5 else ''})")
    if torn:
        warnings.append(f"torn last line (a write cut short by a crash) in {', '.join(os.path.basename(p) for p in torn)}")
    empty = [f.path for f in agg.files if f.events == 0]
    if empty:
        warnings.append(f"{len(empty)} file{'s' if len(empty) > 1 else ''} without events: {', '.join(os.path.basename(p) for p in empty[:5])}")
    if agg.unknown:
        warnings.append("unknown event kinds ignored: " + ", ".join(f"{k} ({v})" for k, v in sorted(agg.unknown.items())))
    if agg.key_overflow:
        warnings.append(f"more than {MAX_KEYS} layer/phase pairs: the rest are counted under {OTHER_LAYERS!r}")
    if agg.kinds.get("internal_error"):
        warnings.append(f"{agg.kinds['internal_error']} fusionguard internal_error event(s): see the log")

    endings = []
    crashes = []
    for s in sorted(streams, key=lambda s: (str(s.rank), str(s.host), str(s.pid))):
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
            }
        )
        for c in s.crashes:
            crashes.append({"host": s.host, "pid": s.pid, "rank": s.rank, "kind": "crash", "crash": c["event"], "last_events": c["before"]})
        if ending.startswith("stopped"):
            crashes.append({"host": s.host, "pid": s.pid, "rank": s.rank, "kind": "stopped", "crash": None, "last_events": [compact(x) for x in s.recent]})

    total_dense = sum(r["dense"] for r in rows)
    return {
        "report_version": REPORT_VERSION,
        "run": {
            "files": len(agg.files),
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
            "event_kinds": dict(sorted(agg.kinds.items())),
        },
        "totals": {
            "dense_calls": total_dense,
            "dense_pairs": sum(1 for r in rows if r["dense"]),
            "fused_calls": sum(r["fused_calls"] or 0 for r in rows),
            "compiles": sum(r["compiles"] for r in rows),
            "causes": _sum_causes(rows),
            "scores_bytes_max": max((r["scores_bytes_max"] for r in rows if r["scores_bytes_max"] is not None), default=None),
        },
        "rows": rows,
        "ranks": rank_rows,
        "disagreements": disagreements,
        "endings": endings,
        "crashes": crashes,
        "files": [f.to_dict() for f in agg.files],
        "warnings": warnings,
    }


def _sorted_ranks(ranks: Iterable[Any]) -> List[Any]:
    return sorted(ranks, key=lambda r: (not isinstance(r, int), r if isinstance(r, int) else str(r)))


def _sum_causes(rows: List[Dict[str, Any]]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for r in rows:
        for k, v in r["causes"].items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def build(paths: Iterable[str], last: int = 10) -> Dict[str, Any]:
    """Read every log under ``paths`` and return the report dict (``--format json``)."""
    notes: List[str] = []
    files = find_logs(paths, notes)
    agg = Aggregator(last=last)
    agg.notes = notes
    for f in files:
        try:
            agg.read(f)
        except OSError as exc:
            stats = FileStats(f)
            agg.files.append(stats)
            agg.unknown.setdefault(f"(unreadable file {os.path.basename(f)}: {exc.strerror})", 1)
    return agg.finish()


# -- text ------------------------------------------------------------------------------------------


def _causes_text(causes: Dict[str, int]) -> str:
    return ", ".join(f"{k}×{v}" for k, v in causes.items()) or "-"


def _mem(med: Any, mx: Any) -> str:
    if med is None and mx is None:
        return "-"
    return f"{human_bytes(med)} / {human_bytes(mx)}"


def _table(headers: List[str], rows: List[List[str]], right: Iterable[int] = ()) -> List[str]:
    right = set(right)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    def line(cells: List[str]) -> str:
        return "  ".join(c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)).rstrip()
    return [line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]


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


def render_text(rep: Dict[str, Any]) -> str:
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
        out.append("  devices:  " + "; ".join(f"{h}: " + _devices_text(d) for h, d in sorted(run["devices"].items())))
    out.append(f"  time:     {fmt_ts(run['first_ts'])} -> {fmt_ts(run['last_ts'])} ({fmt_duration(run['duration_s'])})")
    if run["schemas"]:
        out.append("  schema:   " + ", ".join(f"{k}" for k in sorted(run["schemas"])))
    endings: Dict[str, List[str]] = {}
    for e in rep["endings"]:
        endings.setdefault(e["ending"], []).append(str(e["rank"]))
    out.append("  ended:    " + "; ".join(f"{k} (rank {','.join(v) if len(v) < 9 else rank_ranges([int(x) if x.isdigit() else x for x in v])})" for k, v in sorted(endings.items())) if endings else "  ended:    -")
    for w in rep["warnings"]:
        out.append(f"  warning:  {w}")
    out.append("")

    if not rep["rows"]:
        out.append("No FlexAttention events in the input." if run["events"] else "No events in the input.")
    else:
        if totals["dense_calls"]:
            big = f"; largest dense score matrix {human_bytes(totals['scores_bytes_max'])} (fp32)" if totals["scores_bytes_max"] else ""
            out.append(
                f"DENSE: {totals['dense_calls']:,} dense FlexAttention call{'s' if totals['dense_calls'] != 1 else ''} in "
                f"{totals['dense_pairs']} layer/phase pair{'s' if totals['dense_pairs'] != 1 else ''}; causes: {_causes_text(totals['causes'])}{big}"
            )
        else:
            out.append(f"OK: no dense FlexAttention; {totals['fused_calls']:,} fused calls recorded, {totals['compiles']} fused compile record(s)")
        out.append("")
        table_rows = []
        for r in rep["rows"]:
            table_rows.append(
                [
                    r["layer"],
                    r["phase"],
                    f"{r['dense']:,}" if r["dense"] else "0",
                    f"{r['fused_calls']:,}" if r["fused_calls"] is not None else "-",
                    str(r["compiles"]),
                    _causes_text(r["causes"]),
                    _mem(r["alloc_delta_median"], r["alloc_delta_max"]),
                    _mem(r["peak_delta_median"], r["peak_delta_max"]),
                    r["first_dense_call_site"] or "-",
                ]
            )
        out.extend(_table(["layer", "phase", "dense", "fused", "compiled", "causes", "alloc Δ med / max", "peak Δ med / max", "first dense call site"], table_rows, right=(2, 3, 4)))

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
                out.append(f"    {d['layer']} {d['phase']}: dense on rank {rank_ranges(d['dense_ranks'])}, fused on rank {rank_ranges(d['fused_ranks'])}")
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
            out.append(f"  {ev.get('exc_type')}: {str(ev.get('message') or '').splitlines()[0] if ev.get('message') else ''}")
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
                    f"  CUDA memory: allocated {human_bytes(cuda.get('allocated'))}, reserved {human_bytes(cuda.get('reserved'))}, peak {human_bytes(cuda.get('peak'))}"
                )
            if ev.get("frames"):
                out.append(f"  raised at: {ev['frames'][-1]}")
            t0 = ev.get("ts")
            label = "before the crash"
        else:
            last = c["last_events"][-1] if c["last_events"] else {}
            out.append(f"STOPPED {_who(c)}: the log ends at {fmt_ts(last.get('ts'))} without a shutdown event")
            out.append("  (killed: SIGKILL, the OOM killer, a node failure, or the process is still running)")
            t0 = last.get("ts")
            label = "last events"
        if c["last_events"]:
            out.append(f"  {label} (time relative to {'the crash' if c['kind'] == 'crash' else 'the last event'}):")
            for e in c["last_events"]:
                out.append("    " + _event_line(e, t0 if isinstance(t0, (int, float)) else None))
    return "\n".join(out) + "\n"


def _devices_text(names: List[str]) -> str:
    counts: Dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    return ", ".join(f"{v}× {k}" if v > 1 else k for k, v in counts.items())


# -- csv -------------------------------------------------------------------------------------------

CSV_COLUMNS = (
    "layer", "phase", "dense", "fused", "fused_calls", "compiles", "blocked", "causes",
    "alloc_delta_median", "alloc_delta_max", "peak_delta_median", "peak_delta_max",
    "scores_bytes_max", "first_dense_call_site", "dense_ranks", "fused_ranks",
)


def render_csv(rep: Dict[str, Any]) -> str:
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


def render_json(rep: Dict[str, Any]) -> str:
    return json.dumps(rep, indent=1, ensure_ascii=False, default=str) + "\n"


# -- plot ------------------------------------------------------------------------------------------


def short_labels(layers: List[str]) -> Tuple[List[str], Optional[str]]:
    """``model.layers.7.self_attn`` ... -> ``7`` ... and the pattern ``model.layers.<N>.self_attn``,
    when the names share a dotted prefix and suffix and differ in one part."""
    names = [l for l in layers if l not in (NO_LAYER, OTHER_LAYERS)]
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
    return [short.get(l, l) for l in layers], pattern


def plot(rep: Dict[str, Any], path: str) -> str:
    """Per-layer forward/backward peak-memory bars, dense ones in red and labelled. Needs
    matplotlib (``pip install 'fusionguard[plot]'``); raises ImportError otherwise."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = rep["rows"]
    layers = []
    for r in rows:
        if r["layer"] not in layers:
            layers.append(r["layer"])
    by = {(r["layer"], r["phase"]): r for r in rows}
    values = [v for r in rows for v in (r["peak_delta_max"], r["scores_bytes_max"] if r["dense"] else None) if v is not None]
    top = max(values, default=0)
    unit, scale = ("GB", 1e9) if top >= 1e9 else (("MB", 1e6) if top >= 1e6 else ("KB", 1e3))
    n = max(1, len(layers))
    labels, pattern = short_labels(layers)
    fig, ax = plt.subplots(figsize=(min(20.0, max(8.5, (0.6 if pattern is None else 0.3) * n + 5)), 5.4))
    width = 0.38
    colors = {
        ("forward", False): "#7fa7d6",
        ("backward", False): "#2c5d94",
        ("forward", True): "#f08a7e",
        ("backward", True): "#b3261e",
    }
    estimated = False
    dense_labels = []
    for i, layer in enumerate(layers):
        for j, phase in enumerate(("forward", "backward")):
            r = by.get((layer, phase))
            if r is None:
                continue
            dense = bool(r["dense"])
            value = r["peak_delta_max"]
            est = False
            if value is None and dense and r["scores_bytes_max"] is not None:
                value, est = r["scores_bytes_max"], True
                estimated = True
            if value is None:
                continue
            x = i + (j - 0.5) * width
            ax.bar(
                x, value / scale, width=width, color=colors[(phase, dense)],
                edgecolor="black" if dense else "none", linewidth=1.2 if dense else 0,
                hatch="//" if est else None, alpha=0.6 if est else 1.0,
            )
            if dense:
                cause = f" ({next(iter(r['causes']))})" if r["causes"] else ""
                label = f"DENSE {value / scale:.2f} {unit}{cause}"
                if top and value >= 0.45 * top:  # tall bar: the label fits inside it
                    ink = "white" if phase == "backward" and not est else "#5c0d08"
                    ax.text(x, 0.02 * top / scale, label, rotation=90, ha="center", va="bottom", fontsize=7,
                            color=ink, fontweight="bold", clip_on=True)
                else:
                    ax.annotate(label, (x, value / scale), xytext=(0, 4), textcoords="offset points", rotation=90,
                                ha="center", va="bottom", fontsize=7, color="#b3261e", fontweight="bold")
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
    fig.text(0.01, 0.01, sub, fontsize=7, color="#444444")
    handles = [
        Patch(color=colors[("forward", False)], label="forward, fused"),
        Patch(color=colors[("backward", False)], label="backward, fused"),
        Patch(facecolor=colors[("forward", True)], edgecolor="black", label="forward, DENSE"),
        Patch(facecolor=colors[("backward", True)], edgecolor="black", label="backward, DENSE"),
    ]
    if estimated:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="no memory record: dense score-matrix size"))
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, frameon=False)
    if not rows:
        ax.text(0.5, 0.5, "no FlexAttention layers in the input", ha="center", va="center", transform=ax.transAxes)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
