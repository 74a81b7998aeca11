"""Finding fusionguard logs and reading them one line at a time, whatever they hold.

Logs come from crashed, killed and foreign processes, so every input is hostile: a FIFO named
``*.jsonl``, a torn last line, a 1 GB line, a field of the wrong type, a lone surrogate, nesting
too deep to decode. This module turns each of them into a count in ``FileStats`` (reported as a
warning), never an exception, and holds at most one line (``MAX_LINE``) in memory.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from fusionguard.report.crashfile import open_for_reading

SUPPORTED_SCHEMA = 1
MAX_LINE = 16 * 1024 * 1024
_DECODER = json.JSONDecoder()
_ROTATED = re.compile(r"^(?P<base>.+\.jsonl)(?:\.(?P<n>\d+))?$")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class ReportError(Exception):
    """Bad input that leaves nothing to report on (exit status 2)."""


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


def input_named(out: str, paths: Iterable[str]) -> Optional[str]:
    """The input that writing ``out`` would destroy (None: none): an input file by any name (a
    symlink, a hard link: the same device and inode), a log read from an input directory, or a
    log's name (``*.jsonl``, ``*.jsonl.N``) inside an input directory, whether it exists yet or
    not. Checked before ``report`` writes anything: ``--html x.jsonl`` over ``x.jsonl`` used to
    replace the log."""
    out = os.fspath(out)
    try:
        st = os.stat(out)
        ident: Optional[Tuple[int, int]] = (st.st_dev, st.st_ino)
    except OSError:
        ident = None
    real_out = os.path.realpath(out)
    log_name = _ROTATED.match(os.path.basename(real_out)) is not None
    for raw in paths:
        path = os.fspath(raw)
        if log_name and os.path.isdir(path):
            real_dir = os.path.realpath(path)
            if os.path.commonpath([real_dir, real_out]) == real_dir:
                return path
        if ident is None:
            continue
        try:
            files = find_logs([path], [], [])
        except ReportError:  # a missing input: build() says so
            continue
        for f in files:
            try:
                st = os.stat(f)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == ident:
                return f
    return None


class FileStats:
    """What reading one file found: its size and events, and each kind of bad line (the
    report's warnings say how many, and where the first ones are)."""

    __slots__ = (
        "path",
        "bytes",
        "lines",
        "events",
        "corrupt",
        "corrupt_lines",
        "torn_last_line",
        "oversized",
        "schemas",
        "headers",
        "known",
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
    "event",
    "level",
    "thread",
    "hostname",
    "layer",
    "phase",
    "path",
    "cause",
    "action",
    "template",
    "reason",
    "of",
    "function",
    "where",
    "exc_type",
    "diagnosis",
    "message",
    "error",
    "file",
    "fusionguard",
    "torch",
    "triton",
    "python",
    "version",
    "source",
)
_INT_FIELDS = ("seq", "pid", "rank", "line", "world_size", "local_rank")
_COUNT_FIELDS = (  # never negative: a count of -5 would take calls away
    "scores_bytes",
    "scores_bytes_max",
    "scores_bytes_last",
    "count",
    "total",
    "flex_calls",
    "calls",
    "dense",
    "fused",
    "dense_recompute",
    "measured",
    "predicted_bytes",
    "predicted_bytes_max",
    "free_bytes",
    "estimated_bytes",
    "estimated_bytes_max",
)
_NUM_FIELDS = (
    "alloc_delta",
    "peak_delta",
    "alloc_delta_max",
    "alloc_delta_last",
    "peak_delta_max",
    "peak_delta_last",
    "allocated",
    "reserved",
    "peak",
)
_CHECKS: Dict[str, Callable[[Any], bool]] = {
    **{k: _is_str for k in _STR_FIELDS},
    **{k: _is_int for k in _INT_FIELDS},
    **{k: _is_count for k in _COUNT_FIELDS},
    **{k: _is_num for k in _NUM_FIELDS},
    "ts": _is_ts,
    "schema": lambda v: _is_int(v) or _is_str(v),
    "recompute": lambda v: v.__class__ is bool or _is_int(v),
    "allowed": lambda v: v.__class__ is bool or _is_count(v),  # a dense event's flag; a summary row's count
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

    with open_for_reading(path) as fh:
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
