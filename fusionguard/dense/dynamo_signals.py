"""Listen to Dynamo's own signals: recompile-limit hits, suppressed compile errors, skipped frames.

Two sources, both Dynamo's, neither changes the host's logging setup:
- a ``logging.Handler`` *added* to ``torch._dynamo.convert_frame`` (no level or propagation is
  touched): Dynamo logs "torch._dynamo hit config.recompile_limit ... last reason: ..." and
  "WON'T CONVERT ..." there at WARNING;
- Dynamo's per-frame compilation metrics (``torch._dynamo.utils._compilation_metrics``), read when
  a compile ends (``torch._dynamo.callback`` end callback): frames that failed or were skipped,
  with Dynamo's failure type and reason.

What is heard is kept per code location (file, first line) so a later dense call can find its
cause by walking its own stack, and is logged right away so the log shows the slide to dense in
order.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import weakref
from typing import Any, Callable, Dict, Optional, Tuple

from fusionguard import torch_internals as ti
from fusionguard.core.frames import FG_DIR, is_torch_file
from fusionguard.core.registry import PatchRegistry
from fusionguard.core.state import on_fork_reinit

Key = Tuple[str, int]
_DYNAMO_LOGGER = ti.DYNAMO_CONVERT_FRAME_LOGGER  # where Dynamo logs frames it could not convert

_FUNC_INFO = re.compile(r"'(?P<name>[^']*)' \((?P<file>.*):(?P<line>\d+)\)")
_WONT_CONVERT = re.compile(r"WON'T CONVERT (?P<name>\S+) (?P<file>.+?) line (?P<line>\d+)")
_PUBLIC_FLEX_FILE = os.path.join("nn", "attention", "flex_attention.py")


def is_public_flex(function: object, filename: str) -> bool:
    """PyTorch's public ``flex_attention``: the frame ``torch.compile(flex_attention)`` compiles."""
    return function == "flex_attention" and filename.endswith(_PUBLIC_FLEX_FILE)


def _reportable(info: dict) -> bool:
    """Signals about the user's code, and about PyTorch's public flex_attention when the user
    compiled it directly (``torch.compile(flex_attention)``, the common pattern)."""
    return not is_torch_file(info["file"]) or is_public_flex(info.get("function"), info["file"])


def reason_summary(text: object, limit: int = 300) -> str:
    """Dynamo's multi-line graph-break text as one line: the headline and its explanation."""
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    out = lines[0]
    for ln in lines[1:]:
        if ln.startswith("Explanation:"):
            out += " - " + ln[len("Explanation:") :].strip()
            break
    return out[:limit]


_COMPILE_PREFIX = re.compile(r"^\s*\d+/\d+(?:/\d+)?:\s*")
_SIZE = re.compile(r"tensor '(?P<name>.+?)' (?P<what>size|stride) mismatch at index (?P<index>\d+)")
_SOURCE = re.compile(r"^[LG]\[['\"](?P<name>[^'\"]+)['\"]\]")
_EQUALS = re.compile(r"^(?P<lhs>\S.*?) == (?P<rhs>.+)$")


def clean_reason(text: object, limit: int = 300) -> Optional[str]:
    """One guard-failure reason of Dynamo's as one line: no compile-id prefix ("0/1: "), no
    trailing source comment, no user stack."""
    if not text:
        return None
    line = _COMPILE_PREFIX.sub("", str(text).strip().splitlines()[0])
    line = re.split(r"\s{2,}#", line, maxsplit=1)[0].strip()
    return line[:limit] or None


def _source_name(source: str) -> str:
    """``L['q']`` -> ``q``, ``G['n']`` -> ``n``, ``L['self'].n`` -> ``self.n``."""
    m = _SOURCE.match(source)
    return m.group("name") + source[m.end() :] if m else source


def reason_varies(reason: Optional[str]) -> Optional[str]:
    """What changes between compiles, in a few words: ``q dim 2 varies``."""
    if not reason:
        return None
    m = _SIZE.search(reason)
    if m:
        name = _source_name(m.group("name"))
        if m.group("what") == "size":
            return f"{name} dim {m.group('index')} varies"
        return f"{name} stride {m.group('index')} varies"
    m = re.match(r"(?P<fn>\S+?)\.__closure__", reason)
    if m:
        return f"a value {_source_name(m.group('fn'))} closes over varies"
    if "cell_contents" in reason:
        return "a value a function closes over varies"
    if "___check_obj_id" in reason or "__code__" in reason:
        return "a new function object each call"
    m = _EQUALS.match(reason)
    if m:
        return f"{_source_name(m.group('lhs'))} varies"
    return reason[:80]


_ACTUAL = re.compile(r"actual (?P<value>[^,\s]+)")
_OBJ_ID = re.compile(r"___check_obj_id\((?P<source>[^,]+),\s*(?P<value>\d+)\)")
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e-?\d+)?")
_LOCAL = re.compile(r"^L\[['\"](?P<name>[^'\"]+)['\"]\]$")


def guard_value(reason: str, id_matched: Any = ()) -> Tuple[Optional[str], Optional[str]]:
    """(which guard, the value it saw) of one guard-failure reason, or (None, None) for a guard
    that carries no value: a mode (grad mode, dispatch keys), a flag (``== True``), or an identity
    Dynamo's limit does not count (``id_matched``: the frame's own module of another layer)."""
    m = _SIZE.search(reason)
    if m:
        actual = _ACTUAL.search(reason, m.end())
        return f"{m.group('name')} {m.group('what')} {m.group('index')}", actual.group("value") if actual else _NUMBER.sub("#", reason)
    m = _OBJ_ID.search(reason)
    if m:
        local = _LOCAL.match(m.group("source").strip())
        if local is not None and local.group("name") in id_matched:
            return None, None
        return "id " + m.group("source"), m.group("value")
    m = _EQUALS.match(reason)
    if m:
        rhs = m.group("rhs").strip()
        return (None, None) if rhs in ("True", "False", "None") else (m.group("lhs"), rhs)
    values = _NUMBER.findall(reason)
    if not values or set(values) <= {"0", "1"}:  # (no value, or a flag spelled 0 / 1: requires_grad=1)
        return None, None
    return _NUMBER.sub("#", reason), " ".join(values)


def churning(failures: list, id_matched: Any = ()) -> Optional[str]:
    """The reason of a guard that failed again and again with new values (two or more distinct
    values among a frame's guard failures, ``ti.guard_failures``): churn that goes on until the
    recompile limit. A few distinct modes are not churn: grad mode, dispatch keys, the training
    flag, one partial batch (one value). None when nothing churns."""
    seen: Dict[str, set] = {}
    for text in failures[-512:]:
        reason = clean_reason(text)
        if not reason:
            continue
        key, value = guard_value(reason, id_matched)
        if key is None:
            continue
        values = seen.setdefault(key, set())
        values.add(value)
        if len(values) >= 2:
            return reason
    return None


def reason_fix(reason: Optional[str], fallback: str) -> str:
    """The fix for what Dynamo says changes (``fallback`` when the reason is not recognised)."""
    if not reason:
        return fallback
    m = _SIZE.search(reason)
    if m and m.group("what") == "size":
        name, index = _source_name(m.group("name")), m.group("index")
        return (
            f"mark the dim dynamic: torch._dynamo.mark_dynamic({name}, {index}) before the call, or "
            "torch.compile(..., dynamic=True); or bucket / pad the lengths to a few sizes"
        )
    if "__closure__" in reason or "cell_contents" in reason or "___check_obj_id" in reason or "__code__" in reason:
        return (
            "build the BlockMask and define mask_mod / score_mod once, outside the step (a new "
            "function or a new closed-over value is a new graph); pass values that change as tensors"
        )
    if _EQUALS.match(reason):
        return (
            "pass the changing Python value as a tensor (its value is not guarded) or keep it "
            "constant; a mask_mod / score_mod that closes over it should read a tensor instead"
        )
    return fallback


def latest_reasons(code: Any, entries: int) -> list:
    """Dynamo's guard-failure reasons of the latest recompile of ``code`` (one per cache entry
    that failed, the newest entry first; ``entries``: how many it had then), cleaned and without
    repeats."""
    failures = ti.guard_failures(code)
    if entries > 0:
        failures = failures[-entries:]
    out: list = []
    for text in failures:
        r = clean_reason(text)
        if r and r not in out:
            out.append(r)
    return out[:5]


def _is_limit_hit(fail_type: object, fail_reason: object) -> bool:
    """A compilation-metrics record of a recompile-limit hit (2.7 names the exception after it;
    later releases raise ``Unsupported`` "Dynamo recompile limit exceeded")."""
    text = f"{fail_type} {fail_reason}".lower()
    return "recompilelimit" in text or "cachelimitexceeded" in text or "recompile limit exceeded" in text or "cache_size_limit" in text


def _limit_in(fail_reason: object) -> Optional[int]:
    """The limit Dynamo's limit-hit explanation states ("currently set to 8"), or None."""
    m = re.search(r"currently set to (\d+)", str(fail_reason or ""))
    return int(m.group(1)) if m else None


def _none() -> None:
    return None


def break_counts() -> Dict[str, int]:
    """Dynamo's graph-break records, reason -> count: those it took as graph breaks and those
    not yet classed (an ``Unsupported`` counts as "unimplemented" until its frame breaks)."""
    counts = ti.dynamo_counters("unimplemented")
    for r, n in ti.dynamo_counters("graph_break").items():
        counts[r] = counts.get(r, 0) + n
    return counts


class Signals:
    """What Dynamo said, per code location."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.recompile_limit: Dict[Key, dict] = {}
        self.compile_error: Dict[Key, dict] = {}
        self.frame_failure: Dict[Key, dict] = {}
        self._seen_ids: Dict[int, Any] = {}
        self._last_metric: Any = None  # the newest metrics record read (the dense path's quick check)
        self._frames: Dict[str, Tuple[Any, Any, Any]] = {}  # frame part of a compile id -> (name, file, line)
        self._handler: Optional[logging.Handler] = None
        self._end_callback: Optional[Callable[..., None]] = None
        # What Dynamo could not trace in the FlexAttention calls of each frame (file, first line):
        # (that compile, weakly; graph-break reasons) of the frame's latest compile holding one.
        self.breaks: Dict[Key, Tuple[Any, list]] = {}
        self.emit: Callable[..., Any] = lambda *a, **k: None
        self.on_error: Callable[[str, BaseException], None] = lambda where, exc: None

    def connect(self, emit: Callable[..., Any], on_error: Callable[[str, BaseException], None]) -> None:
        """Where what is heard goes (``emit(level, event, **fields)``) and where our own failures go."""
        self.emit = emit
        self.on_error = on_error

    # -- install / remove ---------------------------------------------------------------------
    def install(self, registry: Optional[PatchRegistry] = None) -> list:
        """Add the log handler and the compile-end callback; each one's undo goes into ``registry``."""
        installed = []
        if self._handler is None:
            handler = self._handler = _DynamoLogHandler(self)
            logger = logging.getLogger(_DYNAMO_LOGGER)
            logger.addHandler(handler)
            installed.append("logging:" + _DYNAMO_LOGGER)
            if registry is not None:
                registry.add_hook("logging:" + _DYNAMO_LOGGER, self._stop_listening, lambda: handler not in logger.handlers)
        callback_handler = ti.compile_callbacks()
        if self._end_callback is None and callback_handler is not None:
            try:

                def _on_compile_end(*_args: Any) -> None:
                    try:
                        self.read_metrics()
                    except Exception as exc:  # never disturb Dynamo
                        self.on_error("dynamo_signals.compile_end", exc)

                ti.add_compile_callbacks(None, _on_compile_end)
                self._end_callback = _on_compile_end
                installed.append("torch._dynamo.callback.on_compile_end")
                if registry is not None:
                    registry.add_hook(
                        "torch._dynamo.callback.on_compile_end",
                        self._remove_callback,
                        lambda: not ti.compile_callback_registered(_on_compile_end, end=True),
                    )
            except Exception:
                pass
        try:
            metrics = ti.compilation_metrics()
            for m in metrics:
                self._mark_seen(m)
                self._note_frame(m)
            self._last_metric = metrics[-1] if metrics else None
        except Exception:
            pass
        return installed

    def _mark_seen(self, metric: Any) -> bool:
        """True the first time a metrics record is seen (Dynamo's deque is capped: track ids)."""
        key = id(metric)
        if key in self._seen_ids:
            return False
        self._seen_ids[key] = metric  # keep it alive so its id is not reused
        while len(self._seen_ids) > 512:
            self._seen_ids.pop(next(iter(self._seen_ids)))
        return True

    def _stop_listening(self) -> None:
        """The log handler's undo (``disable()``): out, and what was heard forgotten, so a later
        ``enable()`` starts with nothing heard (the compile-end callback, recorded after the
        handler, is out already: nothing is added back)."""
        self._remove_handler()
        with self.lock:
            self.recompile_limit.clear()
            self.compile_error.clear()
            self.frame_failure.clear()
            self.breaks.clear()

    def _remove_handler(self) -> None:
        if self._handler is not None:
            logging.getLogger(_DYNAMO_LOGGER).removeHandler(self._handler)
            self._handler = None

    def _remove_callback(self) -> None:
        if self._end_callback is not None:
            try:
                ti.remove_compile_callbacks(None, self._end_callback)
            except Exception:
                pass
            self._end_callback = None

    # -- sources ------------------------------------------------------------------------------
    def on_log_record(self, record: logging.LogRecord) -> None:
        msg = record.msg if isinstance(record.msg, str) else str(record.msg)
        if msg.startswith("torch._dynamo hit config."):
            args = record.args if isinstance(record.args, tuple) else ()
            text = record.getMessage()
            m = _FUNC_INFO.search(text)
            if not m:
                return
            limit_type = args[0] if len(args) > 0 else None
            reason = str(args[3]) if len(args) > 3 else None
            if reason is None:
                rm = re.search(r"last reason: (.*)", text)
                reason = rm.group(1) if rm else None
            info: Dict[str, Any] = {
                "function": m.group("name"),
                "file": m.group("file"),
                "line": int(m.group("line")),
                "limit_type": limit_type,
                "limit": args[1] if len(args) > 1 else None,
                "reason": reason,
            }
            with self.lock:
                self.recompile_limit[(info["file"], info["line"])] = info
            if _reportable(info):
                self.emit("warning", "recompile_limit", **info)
        elif "WON'T CONVERT" in msg:
            text = record.getMessage()
            m = _WONT_CONVERT.search(text)
            if not m:
                return
            error = None
            if record.exc_info and record.exc_info[1] is not None:
                exc = record.exc_info[1]
                text = " ".join(str(exc).split())  # Dynamo's messages span lines; keep them readable
                error = f"{type(exc).__name__}: {text}"[:400]
            info = {"function": m.group("name"), "file": m.group("file"), "line": int(m.group("line")), "error": error}
            with self.lock:
                self.compile_error[(info["file"], info["line"])] = info
            if _reportable(info):
                self.emit("warning", "compile_error", **info)

    def refresh(self) -> None:
        """``read_metrics`` if Dynamo recorded anything since the last look (one comparison
        otherwise): the dense path's way to hear of a recompile-limit hit with Dynamo's logs
        silenced (no compile-end callback runs for one)."""
        last = ti.last_compilation_metric()
        if last is not None and last is not self._last_metric:
            self.read_metrics()

    def read_metrics(self) -> None:
        """Pick up frames Dynamo failed on or skipped since the last look."""
        try:
            metrics = ti.compilation_metrics()
        except Exception:
            return
        if metrics:
            self._last_metric = metrics[-1]
        for m in metrics:
            if not self._mark_seen(m):
                continue
            fail_type = getattr(m, "fail_type", None)
            filename = getattr(m, "co_filename", None)
            frame_id = self._note_frame(m)
            if fail_type and _is_limit_hit(fail_type, getattr(m, "fail_reason", None)):
                # (2.13 records a limit hit before naming the frame: named from its frame's
                # earlier records, by the frame part of the compile id)
                self._limit_from_metrics(m, self._frames.get(frame_id))
                continue
            if not fail_type or not filename:
                continue
            info = {
                "function": getattr(m, "co_name", None),
                "file": filename,
                "line": getattr(m, "co_firstlineno", None),
                "fail_type": fail_type,
                "reason": (getattr(m, "fail_reason", None) or "").strip().splitlines()[0:1],
                "break_file": getattr(m, "fail_user_frame_filename", None),
                "break_line": getattr(m, "fail_user_frame_lineno", None),
            }
            info["reason"] = info["reason"][0] if info["reason"] else None
            key = (filename, info["line"])
            with self.lock:
                self.frame_failure[key] = info
            if not is_torch_file(filename) and fail_type not in ("RecompileLimitExceeded",):
                self.emit("warning", "graph_break", **info)

    def _note_frame(self, m: Any) -> str:
        """Remember which frame a compile id's frame part names; returns that part."""
        frame_id = str(getattr(m, "compile_id", "")).split("/")[0]
        filename = getattr(m, "co_filename", None)
        if filename and frame_id:
            self._frames[frame_id] = (getattr(m, "co_name", None), filename, getattr(m, "co_firstlineno", None))
            while len(self._frames) > 4096:
                self._frames.pop(next(iter(self._frames)))
        return frame_id

    def _limit_from_metrics(self, m: Any, named: Optional[Tuple[Any, Any, Any]]) -> None:
        """A recompile-limit hit read from Dynamo's metrics (also with its logs silenced)."""
        name, filename, line = named or (None, None, None)
        filename = getattr(m, "co_filename", None) or filename
        if not filename:
            return  # the frame's earlier records are gone: the dense path's cache-entry count says it
        self.note_limit(
            {
                "function": getattr(m, "co_name", None) or name,
                "file": filename,
                "line": getattr(m, "co_firstlineno", None) or line,
                "limit_type": ti.recompile_limit_option(),
                "limit": _limit_in(getattr(m, "fail_reason", None)),
                "reason": clean_reason(getattr(m, "recompile_reason", None)),
                "source": "compilation_metrics",
            }
        )

    def note_limit(self, info: Dict[str, Any]) -> None:
        """A recompile-limit hit heard elsewhere than Dynamo's log: kept and logged, unless its
        log record was heard first (one ``recompile_limit`` event per frame)."""
        key = (info["file"], info["line"])
        with self.lock:
            if key in self.recompile_limit:
                return
            self.recompile_limit[key] = info
        if _reportable(info):
            self.emit("warning", "recompile_limit", **info)

    def flex_traced(self, code: Any, before: Dict[str, int]) -> None:
        """Dynamo traced a FlexAttention call in the frame it compiles (``code``): keep the
        graph-break reasons it recorded meanwhile (``before``: ``break_counts()`` then) as that
        frame's. A count that went up is new; one Dynamo took back (a speculation) went down."""
        added = [r for r, n in break_counts().items() if n > before.get(r, 0)]
        key = (code.co_filename, code.co_firstlineno)
        compile = ti.current_compile()
        with self.lock:
            old = self.breaks.pop(key, None)
            if old is not None and compile is not None and old[0]() is compile:
                added = old[1] + [r for r in added if r not in old[1]]  # another call of the same compile
            self.breaks[key] = (weakref.ref(compile) if compile is not None else _none, added)
            while len(self.breaks) > 4096:
                self.breaks.pop(next(iter(self.breaks)))

    def this_frame(self, frame: Any) -> Tuple[Optional[list], list, Optional[dict]]:
        """The evidence about the frame that made a FlexAttention call, ``frame`` being one below
        that call: the graph-break reasons (one line each) Dynamo recorded while it traced the
        FlexAttention calls of that frame's latest compile, the frame being the nearest one up
        the stack that is neither PyTorch's nor fusionguard's (where it has none: those of
        PyTorch's frames between it and the call, e.g. ``torch.compile(flex_attention)``).
        None when none is known: never another frame's. And that frame's record when Dynamo
        gave up on it, and that frame's compile error when compiling it failed (Dynamo then traces
        the nested frames, flex's dense implementation among them, depending on what the process
        ran before: the label must follow the evidence, not that history). Asked at trace time, by
        the dense path Dynamo inlines."""
        chain: list = []
        user: Optional[Key] = None
        depth = 256
        while frame is not None and depth:
            filename = frame.f_code.co_filename
            if not filename.startswith(FG_DIR):
                key = (filename, frame.f_code.co_firstlineno)
                if not is_torch_file(filename):
                    user = key
                    break
                chain.append(key)
            frame, depth = frame.f_back, depth - 1
        self.read_metrics()
        with self.lock:
            own = self.breaks.get(user, (None, []))[1] if user is not None else []
            found = own or [r for key in reversed(chain) for r in self.breaks.get(key, (None, []))[1]]
            failed = self.frame_failure.get(user) if user is not None else None
        reasons: list = []
        for r in found:
            line = reason_summary(r)
            if line and line not in reasons:
                reasons.append(line)
        frames = [f"{failed['function']} ({failed['file']}:{failed['line']}): {failed.get('reason')}"] if failed else []
        cause, info = self.lookup(*user) if user is not None else (None, None)
        return reasons or None, frames, info if cause == "compile_error" else None

    def lookup(self, filename: str, firstlineno: int) -> Tuple[Optional[str], Optional[dict]]:
        key = (filename, firstlineno)
        with self.lock:
            if key in self.recompile_limit:
                return "recompile_limit", self.recompile_limit[key]
            if key in self.compile_error:
                return "compile_error", self.compile_error[key]
            if key in self.frame_failure:
                info = self.frame_failure[key]
                if "RecompileLimit" in str(info.get("fail_type")):
                    return "recompile_limit", info
                if info.get("fail_type") == "Unsupported":
                    return "graph_break", info
                return "compile_error", info
        return None, None


class _DynamoLogHandler(logging.Handler):
    def __init__(self, signals: Signals) -> None:
        super().__init__(level=logging.WARNING)
        self._signals = signals

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._signals.on_log_record(record)
        except Exception as exc:  # never disturb Dynamo's logging
            self._signals.on_error("dynamo_signals.log_handler", exc)


SIGNALS = Signals()


def _lock_after_fork(reinit: Callable[[Any], Any]) -> None:
    SIGNALS.lock = reinit(SIGNALS.lock)


on_fork_reinit(_lock_after_fork)  # (a forked child's lock is free: core.state's fork hooks)
