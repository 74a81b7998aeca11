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
import stat
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, List, Optional, Tuple

from ._format import causes_text as _causes_text
from ._format import escape, human_bytes
from .events import KNOWN_EVENTS
from ._format import mem_text as _mem
from ._format import table as _table

from . import crash
from .crash import open_for_reading as _open_regular

SUPPORTED_SCHEMA = 1
REPORT_VERSION = 2  # 2: rows' fused = calls (never compile records), allowed apart from dense
MAX_LINE = 16 * 1024 * 1024
RESERVOIR = 2048
MAX_CRASHES_SHOWN = 4  # crash/stop sections in the text report (all in --format json)
MAX_KEYS = 10_000
NO_LAYER = "(no layer)"
OTHER_LAYERS = "(other layers)"
_DECODER = json.JSONDecoder()
_ROTATED = re.compile(r"^(?P<base>.+\.jsonl)(?:\.(?P<n>\d+))?$")
_PHASE_ORDER = {"forward": 0, "backward": 1}
_DIGITS = re.compile(r"[0-9]+")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_DIGIT_SPLIT = re.compile(r"([0-9]+)")


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


def _int(x: Any) -> Optional[int]:
    return int(x) if isinstance(x, int) and not isinstance(x, bool) else None


def _short(x: Any, n: int = 200) -> Any:
    if isinstance(x, str) and len(x) > n:
        return x[: n - 3] + "..."
    return x


def site_text(site: Any) -> Optional[str]:
    if not isinstance(site, dict) or not site.get("file"):
        return None
    return f"{site.get('file')}:{site.get('line')} in {site.get('function')}"


def natural_key(text: str) -> Tuple:
    if text in (NO_LAYER, OTHER_LAYERS):
        return (1, text)
    # [0-9] only: str.isdigit() is also true for "²", which int() refuses
    return (0,) + tuple((0, int(p), "") if _DIGITS.fullmatch(p) else (1, 0, p) for p in _DIGIT_SPLIT.split(text))


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


def _regular(path: str) -> bool:
    """A regular file (after links): a FIFO or a link to /dev/zero named ``*.jsonl`` is never
    opened (reading it would block or never end)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def find_logs(paths: Iterable[str], notes: Optional[List[str]] = None, ignored: Optional[List[Dict[str, str]]] = None) -> List[str]:
    """Files to read, in order; directories give every ``*.jsonl`` (and rotated ``*.jsonl.N``,
    oldest first) below them that is a regular file (others go to ``ignored``). A file is read
    alone; its rotated parts, if any, are mentioned in ``notes``. A directory without logs goes
    to ``ignored`` (ReportError when ``ignored`` is None). Raises ReportError for a missing path
    or a path that is not a regular file or directory."""
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
                        full = os.path.join(root, name)
                        if not _regular(full):
                            if ignored is not None:
                                ignored.append({"path": full, "reason": "not a regular file"})
                            continue
                        n = int(m.group("n")) if m.group("n") else 0
                        found.append((os.path.join(root, m.group("base")), -n, full))
            if not found:  # beside other inputs (a rank that died before writing): listed, not fatal
                if ignored is None:
                    raise ReportError(f"no fusionguard logs (*.jsonl) in directory {path}")
                ignored.append({"path": path, "reason": "no fusionguard logs (*.jsonl) in this directory"})
                continue
            files_in_order = [f for _, _, f in sorted(found)]
        elif _regular(path):
            files_in_order = [path]
            if notes is not None and path.endswith(".jsonl") and os.path.exists(path + ".1"):
                notes.append(
                    f"{os.path.basename(path)} has rotated parts ({os.path.basename(path)}.1 ...) that were not read: "
                    "pass its directory to include them"
                )
        elif os.path.exists(path):
            raise ReportError(f"not a regular file or directory: {path}")
        else:
            raise ReportError(f"no such file or directory: {path}")
        for f in files_in_order:
            real = os.path.realpath(f)
            if real not in seen:
                seen.add(real)
                out.append(f)
    return out


class FileStats:
    __slots__ = (
        "path", "bytes", "lines", "events", "corrupt", "corrupt_lines", "torn_last_line", "oversized", "schemas",
        "headers", "known",
    )

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
        self.known = 0  # events of a fusionguard kind: 0 means the file is not a fusionguard log

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


# -- field types: a line whose known field has the wrong type is corrupt ----------------------------

_INT_RANGE = 2**63


def _is_int(v: Any) -> bool:
    return v.__class__ is int and -_INT_RANGE <= v < _INT_RANGE


def _is_count(v: Any) -> bool:
    return v.__class__ is int and 0 <= v < _INT_RANGE


def _is_num(v: Any) -> bool:
    c = v.__class__
    return (c is int and -_INT_RANGE <= v < _INT_RANGE) or (c is float and math.isfinite(v))


def _is_str(v: Any) -> bool:
    return v.__class__ is str


def _is_ts(v: Any) -> bool:  # Unix seconds that time.gmtime can show
    return _is_num(v) and 0 <= v < 1e11


def _list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v.__class__ is list and all(check(x) for x in v)


def _dict_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v.__class__ is dict and all(_is_str(k) and (x is None or check(x)) for k, x in v.items())


def _fields(v: Any) -> bool:
    return v.__class__ is dict and _valid(v)


_STR_FIELDS = (
    "event", "level", "thread", "hostname", "layer", "phase", "path", "cause", "action", "template", "reason", "of",
    "function", "where", "exc_type", "diagnosis", "message", "error", "file", "fusionguard", "torch", "triton",
    "python", "version", "source",
)
_INT_FIELDS = ("seq", "pid", "rank", "line", "world_size", "local_rank")
_COUNT_FIELDS = (  # never negative: a count of -5 would take calls away
    "scores_bytes", "scores_bytes_max", "scores_bytes_last", "count", "total", "flex_calls", "calls", "dense",
    "fused", "dense_recompute", "measured",
)
_NUM_FIELDS = (
    "alloc_delta", "peak_delta", "alloc_delta_max", "alloc_delta_last", "peak_delta_max", "peak_delta_last",
    "allocated", "reserved", "peak",
)
_CHECKS: Dict[str, Callable[[Any], bool]] = {
    **{k: _is_str for k in _STR_FIELDS},
    **{k: _is_int for k in _INT_FIELDS},
    **{k: _is_count for k in _COUNT_FIELDS},
    **{k: _is_num for k in _NUM_FIELDS},
    "ts": _is_ts,
    "schema": lambda v: _is_int(v) or _is_str(v),
    "recompute": lambda v: v.__class__ is bool or _is_int(v),
    "allowed": lambda v: v.__class__ is bool,
    "layers": _list_of(_is_str),
    "frames": _list_of(_is_str),
    "devices": _list_of(_is_str),
    "causes": _dict_of(_is_count),
    "counts": _dict_of(_is_num),
    "call_site": _fields,
    "last_flex": _fields,
    "cuda": _fields,
    "rows": _list_of(_fields),
}


def _valid(e: dict) -> bool:
    """Every field the report reads has its type (null is always fine); others are not looked at."""
    checks = _CHECKS
    for k, v in e.items():
        if v is not None:
            check = checks.get(k)
            if check is not None and not check(v):
                return False
    return True


def _has_surrogate(obj: Any) -> bool:
    """A lone surrogate (``"\\ud800"``) decodes to a str that no UTF-8 output can print."""
    if isinstance(obj, str):
        return any("\ud800" <= c <= "\udfff" for c in obj)
    if isinstance(obj, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_has_surrogate(x) for x in obj)
    return False


def read_events(path: str, stats: FileStats) -> Iterator[dict]:
    """Events of one file, one line at a time; bad lines are counted in ``stats``: not JSON,
    not an object with a string ``event``, a known field of the wrong type (a list for ``pid``,
    ``NaN`` for ``ts``), lone surrogates, nesting too deep to decode."""
    max_line = MAX_LINE
    decode = _DECODER.decode

    def loads(raw: bytes) -> Any:
        try:
            obj = decode(raw.decode("utf-8"))
        except RecursionError:  # 100,000 nested brackets
            raise ValueError("nested too deeply") from None
        try:
            if _SURROGATE_ESCAPE.search(raw) and _has_surrogate(obj):
                raise ValueError("lone surrogate")
            if not isinstance(obj, dict) or not isinstance(obj.get("event"), str) or not _valid(obj):
                raise ValueError("not an event")
        except RecursionError:
            raise ValueError("nested too deeply") from None
        return obj

    with _open_regular(path) as fh:
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
            stats.events += 1
            yield obj


# -- aggregation -----------------------------------------------------------------------------------


class Counts:
    """One process's counts for one (layer, phase)."""

    __slots__ = ("dense", "allowed", "blocked", "causes", "runs", "rescued", "layer_calls", "summary_fused", "fused", "compiles", "inlined")

    def __init__(self) -> None:
        self.dense = 0  # dense calls that were not allowed (warned or blocked)
        self.allowed = 0  # dense calls inside allow_dense() (or the debug flag): on purpose
        self.blocked = 0
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
        self.ignored: List[Dict[str, str]] = []  # inputs that are not fusionguard logs, and why
        self.errors = 0  # events the aggregation could not take (counted as corrupt lines)

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
        elif kind == "shutdown":
            s.last_shutdown = str(e.get("reason"))
        elif kind == "header":
            s.header = {k: e.get(k) for k in ("schema", "fusionguard", "torch", "triton", "python", "hostname", "cuda", "world_size", "local_rank", "crash_file", "forked_from")}

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
                if target.synthetic:  # the row is all there is
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
            if not s.synthetic and s.summary_rows:
                self._split_by_summary(s)
        for r, st in synthetic.items():
            self.streams[("(summary)", None, r)] = st

    def _split_by_summary(self, s: Stream) -> None:
        """Name the layers of a process's unattributed fused calls (NO_LAYER: counters of graphs
        holding several layers' calls) from its summary rows, never adding a call: a named layer
        takes what its row counts beyond its own events, out of the unattributed calls. When the
        rows count more than the unattributed calls can cover (rows of an earlier log of the same
        process), nothing is split and a warning says so."""
        phases: Dict[str, List[Tuple[Tuple[str, str], Counts]]] = {}
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

    def finish(self) -> Dict[str, Any]:
        firsts = [st.first_ts for st in self.streams.values() if st.first_ts is not None]
        lasts = [st.last_ts for st in self.streams.values() if st.last_ts is not None]
        self.first_ts = min(firsts) if firsts else None
        self.last_ts = max(lasts) if lasts else None
        self._settle()
        return build_report(self)


def _crash_fields(e: dict) -> Dict[str, Any]:
    keys = ("seq", "ts", "thread", "exc_type", "message", "where", "diagnosis", "last_flex", "cuda", "frames")
    out: Dict[str, Any] = {k: e.get(k) for k in keys if k in e}
    if isinstance(out.get("message"), str):
        out["message"] = _short(out["message"], 1000)
    if isinstance(out.get("frames"), list):
        out["frames"] = [_short(f, 300) for f in out["frames"][-8:]]
    return out


# -- the report (a plain dict: this is also --format json) ------------------------------------------


def _int_or_none(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


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
        for s in streams:
            c = s.counts.get(key)
            if c is None:
                continue
            total.dense += c.dense
            total.allowed += c.allowed
            total.fused += c.fused
            total.compiles += c.compiles
            total.blocked += c.blocked
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
        if not (total.dense or total.allowed or total.fused or total.compiles or total.inlined or agg.keys[key].alloc.n or agg.keys[key].peak.n):
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
                disagreements.append({"layer": row["layer"], "phase": row["phase"], "dense_ranks": row["dense_ranks"], "fused_ranks": row["fused_ranks"]})

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
        warnings.append(f"schema {max(numeric)} is newer than this report understands ({SUPPORTED_SCHEMA}): known fields are read, others ignored")
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
        warnings.append(f"ignored {len(agg.ignored)} input{'s' if len(agg.ignored) > 1 else ''} that {'are' if len(agg.ignored) > 1 else 'is'} not a fusionguard log: {shown}{more}")
    if agg.errors:
        warnings.append(f"{agg.errors} event(s) with fields this report could not read were skipped (counted as corrupt lines)")
    if agg.unknown:
        warnings.append("unknown event kinds ignored: " + ", ".join(f"{k} ({v})" for k, v in sorted(agg.unknown.items())))
    if agg.key_overflow:
        warnings.append(f"more than {MAX_KEYS} layer/phase pairs: the rest are counted under {OTHER_LAYERS!r}")
    if agg.kinds.get("internal_error"):
        warnings.append(f"{agg.kinds['internal_error']} fusionguard internal_error event(s): see the log")

    endings = []
    crashes = []
    for s in sorted(streams, key=lambda s: (str(s.rank), str(s.host), str(s.pid))):
        native = crash.native_crash(s.header.get("crash_file"), s.files, s.recent)  # a segfault/abort
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
            }
        )
        for cr in s.crashes:
            crashes.append({"host": s.host, "pid": s.pid, "rank": s.rank, "kind": "crash", "crash": cr["event"], "last_events": cr["before"]})
        if ending.startswith("stopped"):
            crashes.append({"host": s.host, "pid": s.pid, "rank": s.rank, "kind": "stopped", "crash": None, "last_events": [compact(x) for x in s.recent],
                            "forked_from": _int_or_none(s.header.get("forked_from"))})

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
            "event_kinds": dict(sorted(agg.kinds.items())),
        },
        "totals": {
            "dense_calls": total_dense,
            "dense_pairs": sum(1 for r in rows if r["dense"]),
            "blocked_calls": sum(r["blocked"] for r in rows),
            "allowed_dense_calls": sum(r["allowed"] for r in rows),
            "fused_calls": sum(r["fused"] for r in rows),
            "compiles": sum(r["compiles"] for r in rows),
            "causes": _sum_causes(rows),
            "scores_bytes_max": max((r["scores_bytes_max"] for r in rows if r["scores_bytes_max"] is not None), default=None),
        },
        "rows": rows,
        "ranks": rank_rows,
        "disagreements": disagreements,
        "endings": endings,
        "crashes": crashes,
        "files": [f.to_dict() for f in agg.files if f.known],
        "ignored": list(agg.ignored),
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
    return agg.finish()


# -- text ------------------------------------------------------------------------------------------


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


_ESCAPED_NEWLINE = escape("\n")


def _escaped(obj: Any) -> Any:
    if isinstance(obj, str):
        return escape(obj)
    if isinstance(obj, dict):
        return {(escape(k) if isinstance(k, str) else k): _escaped(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_escaped(x) for x in obj]
    return obj


def render_text(rep: Dict[str, Any]) -> str:
    """The report for people. Every string from a log is escaped first: control characters
    (ESC, newlines) are shown as ``\\x1b``, never sent to the terminal."""
    rep = _escaped(rep)
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

    allowed = totals["allowed_dense_calls"]
    allowed_text = (
        f"{allowed:,} allowed dense call{'s' if allowed != 1 else ''} (allow_dense() or the debug flag: on purpose, not counted as dense)"
        if allowed else ""
    )
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
                f"{totals['dense_pairs']} layer/phase pair{'s' if totals['dense_pairs'] != 1 else ''}; causes: {_causes_text(totals['causes'])}{big}"
            )
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
                _causes_text(r["causes"]),
                _mem(r["alloc_delta_median"], r["alloc_delta_max"]),
                _mem(r["peak_delta_median"], r["peak_delta_max"]),
                r["first_dense_call_site"] or "-",
            ]
            table_rows.append(cells)
        heads = ["layer", "phase", "dense"] + (["allowed"] if show_allowed else []) + [
            "fused", "compiled", "causes", "alloc Δ med / max", "peak Δ med / max", "first dense call site",
        ]
        n = 4 if show_allowed else 3
        out.extend(_table(heads, table_rows, right=range(2, n + 2)))
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
                    f"  CUDA memory: allocated {human_bytes(cuda.get('allocated'))}, reserved {human_bytes(cuda.get('reserved'))}, peak {human_bytes(cuda.get('peak'))}"
                )
            if ev.get("frames"):
                out.append(f"  raised at: {ev['frames'][-1]}")
            t0 = ev.get("ts")
            label = "before the crash"
        else:
            last = c["last_events"][-1] if c["last_events"] else {}
            out.append(f"STOPPED {_who(c)}: the log ends at {fmt_ts(last.get('ts'))} without a shutdown event")
            if c.get("forked_from") is not None:  # a forked worker ends with os._exit: no exit handlers
                out.append(f"  (forked from pid {c['forked_from']}: a worker that ended with os._exit, or killed: SIGKILL, the OOM killer, a node failure, or still running)")
            else:
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
    "layer", "phase", "dense", "allowed", "blocked", "fused", "compiles", "causes",
    "alloc_delta_median", "alloc_delta_max", "peak_delta_median", "peak_delta_max",
    "scores_bytes_max", "first_dense_call_site", "dense_ranks", "fused_ranks",
)


def render_csv(rep: Dict[str, Any]) -> str:
    rep = _escaped(rep)  # as in text: a log's ESC sequences never reach a terminal
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


_JSON_UNSAFE = re.compile("[\x7f-\x9f\u202a-\u202e\u2066-\u2069]")  # json.dumps escapes C0 itself


def render_json(rep: Dict[str, Any]) -> str:
    """JSON; C1 controls, DEL and bidirectional overrides written as ``\\uXXXX`` escapes (the
    decoded data is the same; a terminal showing it is never driven by a log's strings)."""
    text = json.dumps(rep, indent=1, ensure_ascii=False, default=str)
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text) + "\n"


# -- plot ------------------------------------------------------------------------------------------


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


def plot(rep: Dict[str, Any], path: str) -> str:
    """Per-layer forward/backward peak-memory bars, dense ones in red and labelled; without
    any memory figure in the log (CPU runs, ``watch(memory=False)``), dense and fused calls per
    layer instead. Returns a note on what is missing ("" when nothing is). Layer names and
    causes are drawn as they are (no mathtext: a ``$`` is a dollar sign). Needs matplotlib
    (``pip install 'fusionguard[plot]'``); raises ImportError otherwise, OSError for a path
    that cannot be written."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    rep = _escaped(rep)
    measured = any(r["peak_delta_max"] is not None for r in rep["rows"])
    estimated = any(r["dense"] and r["scores_bytes_max"] is not None for r in rep["rows"])
    with plt.rc_context({"text.parse_math": False}):
        if measured or estimated:
            _plot_memory(rep, path)
        else:
            _plot_counts(rep, path)
    if measured:
        return ""
    if estimated:
        return "; no measured memory in the log (CPU run or watch(memory=False)): dense bars show the score-matrix size"
    return "; no memory data in the log (CPU run or watch(memory=False)): dense and fused calls per layer plotted instead"


def _layers(rows: List[Dict[str, Any]]) -> List[str]:
    layers: List[str] = []
    for r in rows:
        if r["layer"] not in layers:
            layers.append(r["layer"])
    return layers


def _finish_plot(plt: Any, fig: Any, ax: Any, rows: list, path: str) -> None:
    """What both charts end with: the empty-input note, the grid, and the file (figure closed)."""
    if not rows:
        ax.text(0.5, 0.5, "no FlexAttention layers in the input", ha="center", va="center", transform=ax.transAxes)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    try:
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def _plot_counts(rep: Dict[str, Any], path: str) -> None:
    import matplotlib.pyplot as plt

    rows = rep["rows"]
    layers = _layers(rows)
    labels, pattern = short_labels(layers)
    by = {(r["layer"], r["phase"]): r for r in rows}
    n = max(1, len(layers))
    fig, ax = plt.subplots(figsize=(min(20.0, max(8.5, 0.6 * n + 5)), 5.4))
    width = 0.2
    bars = [("forward", "fused", "#7fa7d6"), ("forward", "dense", "#f08a7e"), ("backward", "fused", "#2c5d94"), ("backward", "dense", "#b3261e")]
    for j, (phase, kind, color) in enumerate(bars):
        xs = [i + (j - 1.5) * width for i in range(len(layers))]
        ys = [(by.get((name, phase)) or {}).get(kind) or 0 for name in layers]
        ax.bar(xs, ys, width=width, color=color, label=f"{phase}, {kind}")
    ax.set_xticks(range(len(layers)))
    ax.set_xticklabels(labels, rotation=35 if len(layers) > 8 else 0, ha="right" if len(layers) > 8 else "center", fontsize=8)
    if pattern is not None:
        ax.set_xlabel(f"layer: {pattern}", fontsize=9)
    ax.set_ylabel("FlexAttention calls")
    t = rep["totals"]
    ax.set_title(f"fusionguard: calls per attention layer ({t['dense_calls']:,} dense, {t['fused_calls']:,} fused)", fontsize=11, loc="left")
    fig.text(0.01, 0.01, "no memory data in the log (CPU run or watch(memory=False)): call counts shown", fontsize=7, color="#444444")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, frameon=False)
    _finish_plot(plt, fig, ax, rows, path)


def _plot_memory(rep: Dict[str, Any], path: str) -> None:
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
    _finish_plot(plt, fig, ax, rows, path)
