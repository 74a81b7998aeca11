"""Crash-proof JSON-lines event log.

Why this shape:
- one ``os.write`` per event on an ``O_APPEND`` descriptor: a line is never interleaved with
  another thread's or process's line, and a process killed right after keeps every line it wrote
  (the data is in the kernel, not in a Python buffer);
- events at level ``warning`` and above (dense executions, errors) are also ``fsync``-ed before
  the caller goes on, so the record is on disk before the dense kernel allocates; a caller may
  mark an event ``durable=False`` (a repeat of a record already on disk: a dense call from the
  same site, layer and phase), which is written the same way but not fsync-ed (an fsync costs
  0.15 to 0.9 ms on an H200 host: up to 4 % of a dense call; a killed process loses no written line anyway,
  only a kernel crash or power loss can);
- a torn last line left by an earlier crash is closed with a newline before we append, so it can
  never swallow our first line;
- events go through fusionguard's own structlog bound logger (``structlog.wrap_logger`` over
  this log's memory and file: structlog's ``add_log_level`` and ``TimeStamper``, our stamp,
  structlog's ``JSONRenderer``), never
  ``structlog.configure`` nor the process-wide contextvars: the host's structlog and ``logging``
  setup stay theirs (docs/logging.md);
- the file itself is ``sink.FileSink`` (durability) and the sampling ``sampler.Sampler``;
- bounded volume, both optional: a ``Sampler`` keeps the first few fused per-call events per
  (layer, phase), and the first few repeats of one dense call, then writes counter events
  (``fused_calls`` / ``dense_calls``) instead (compile-time records, blocked calls and errors
  are never sampled), and
  ``FileSink(max_bytes=..., backups=...)`` rotates the file by size (``X.jsonl`` ->
  ``X.jsonl.1`` ...), starting each new file with a copy of the header.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
from typing import Any, Callable, ContextManager, Deque, Dict, List, Optional, Tuple, Union

import structlog

from fusionguard.eventlog.distributed import process_group_ready
from fusionguard.eventlog.header import rank_info
from fusionguard.eventlog.kinds import TRACE_EVENTS
from fusionguard.eventlog.messages import logger as human_logger
from fusionguard.eventlog.messages import say
from fusionguard.eventlog.redact import redact_value
from fusionguard.eventlog.sampler import COUNTER_LEVEL, FLUSH_BEFORE, KEEP, Sampler
from fusionguard.eventlog.sink import DEFAULT_LOG_MODE, FileSink
from fusionguard.torch_internals import structured_trace

_DURABLE_LEVELS = frozenset({"warning", "error", "critical"})


def _json_default(obj: Any) -> Any:
    # torch.Size, dtypes, devices, sympy expressions, sets: readable, never a crash.
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)


def dumps(event: dict) -> str:
    return json.dumps(event, default=_json_default, separators=(",", ":"), ensure_ascii=False)


class _EventRank:
    """``rank_info()["rank"]`` for every event, kept once it cannot change any more (torchrun's
    ``RANK`` is set, or a process group is up); until then the environment's answer, read again
    as soon as ``RANK`` appears or a process group comes up."""

    def __init__(self) -> None:
        self.final: Optional[int] = None
        self.env: Optional[int] = None  # from the environment, read again by reset()

    def reset(self) -> None:
        self.final = self.env = None

    def __call__(self) -> int:
        if self.final is not None:
            return self.final
        if self.env is None or "RANK" in os.environ or process_group_ready():
            self.env = rank = rank_info()["rank"]
            if "RANK" in os.environ or process_group_ready():
                self.final = rank
        return self.env


class EventLog:
    """Events in memory (bounded) and, optionally, in a JSON-lines file."""

    def __init__(self, max_events: int = 10_000) -> None:
        self._seq = 0
        self.memory: Deque[dict] = collections.deque(maxlen=max_events)
        self.sink: Optional[FileSink] = None
        self._sink_failed = False
        self._sink_reports = 0  # failure / recovery messages printed for this sink (at most 6)
        # Optional volume control for fused per-call events (None: every event is written).
        self.sampler: Optional[Sampler] = None
        self._header: Optional[dict] = None  # the last header, copied at the top of rotated files
        self._rank = _EventRank()
        self._emit_lock = threading.RLock()
        self.mirror: Optional[Callable[[dict], None]] = None  # e.g. to PyTorch's structured trace
        self.on_sink_error: Optional[Callable[[BaseException], None]] = None
        self.on_sink_resume: Optional[Callable[[int], None]] = None  # with the events not written
        # Set in a forked child (see core.state._after_fork_in_child): opens the child's own file on
        # its first event, so a worker that never logs leaves no file behind.
        self.open_pending: Optional[Callable[[], None]] = None
        # fusionguard's own structlog pipeline (see _Bound): structlog's level and UNIX-time
        # stamps, ours (seq, pid, rank, thread, the field order), structlog's JSON renderer; never
        # structlog.configure() and no merge_contextvars (the host's bound context, secrets
        # included, has no business in this log, and ours none in theirs). Exceptions stay
        # formatted where they are caught (``traceback``, crash's tail): structlog's
        # format_exc_info would write them as ``exception``, without the final newline.
        processors: List[Any] = [structlog.processors.add_log_level, _TIME, self._stamp, _redact, _render]
        self._bound: _Bound = structlog.wrap_logger(
            _LineWriter(self),
            processors=processors,
            wrapper_class=_Bound,
            context_class=dict,
            cache_logger_on_first_use=False,
        ).bind()

    @property
    def write_lock(self) -> ContextManager[Any]:
        """The lock every write holds (re-entrant). Held, no other thread's event can be
        written: for figures that must agree with the events before the next one (the counts
        of a SIGTERM ``shutdown`` event, read in the same hold as its write)."""
        return self._emit_lock

    @property
    def seq(self) -> int:
        """The ``seq`` of the last event stamped (0: none yet); read-only, for readers such as
        the pytest plugin that take the events logged since a mark."""
        return self._seq

    # -- structlog processors -------------------------------------------------------------
    def _stamp(self, logger: Any, method: str, event_dict: dict) -> dict:
        """``seq``, ``pid``, ``rank``, ``thread``; ``event``, ``level``, ``ts`` (stamped by
        structlog's processors before this one) and ``seq`` first, in that order."""
        self._seq += 1  # under self._emit_lock (see _log)
        head = {"event": event_dict.pop("event", None), "level": event_dict.pop("level"), "ts": event_dict.pop("ts"), "seq": self._seq}
        stamped = dict(head)
        stamped.update(event_dict)
        stamped.update(head)  # our stamp wins over a field of the same name, and comes first
        stamped.setdefault("pid", os.getpid())
        if "rank" not in stamped:
            stamped["rank"] = self._rank()
        stamped.setdefault("thread", threading.current_thread().name)
        return stamped

    def _store(self, line: str, event_dict: dict, durable: bool) -> dict:
        """The end of the pipeline (under ``_emit_lock``): memory, then the file."""
        self.memory.append(event_dict)
        if event_dict.get("event") == "header":
            self._header = dict(event_dict)
        self._write_line(line, durable)
        return event_dict

    def _open_pending(self) -> None:
        with self._emit_lock:
            opener, self.open_pending = self.open_pending, None
            if opener is not None:
                opener()

    def header_copy(self) -> Optional[str]:
        """The last header, marked ``rotated``: the first line of a rotated or a forked child's file."""
        header = self._header
        if header is None:
            return None
        return dumps({**header, "rotated": True})

    # -- output -----------------------------------------------------------------------------
    def _write_line(self, line: str, durable: bool) -> None:
        sink = self.sink
        if sink is None:
            return
        try:
            sink.write(line, durable)
        except OSError as exc:  # disk full, file removed, ...: keep going in memory, retry next time
            sink.unwritten += 1
            if not self._sink_failed:
                self._sink_failed = True
                self._sink_reports += 1
                if self.on_sink_error is not None and self._sink_reports <= 6:
                    self.on_sink_error(exc)
            return
        if sink.lock_note is not None:  # once: the lock file was busy past the bounded wait
            note, sink.lock_note = sink.lock_note, None
            say(note + "\n")
        if self._sink_failed:
            self._sink_failed = False
            self._sink_reports += 1
            if self.on_sink_resume is not None and self._sink_reports <= 6:
                self.on_sink_resume(sink.unwritten)

    def open(
        self,
        path: str,
        fsync: Union[bool, str],
        max_bytes: Optional[int] = None,
        backups: int = 3,
        mode: int = DEFAULT_LOG_MODE,
        shared: bool = True,
    ) -> None:
        """Write to the file at ``path`` (``shared=False``: no other process writes it)."""
        self.close()
        self._rank.reset()  # enable() again: torchrun / a spawn may have set RANK since
        self.attach(FileSink(path, fsync=fsync, max_bytes=max_bytes, backups=backups, preamble=self.header_copy, mode=mode, shared=shared))

    def attach(self, sink: Optional[FileSink]) -> None:
        """Write to ``sink`` from now on (the previous one is left as it is)."""
        self.open_pending = None
        self.sink = sink
        self._sink_failed = False
        self._sink_reports = 0

    def after_fork_in_child(self) -> Optional[FileSink]:
        """A forked child starts its own log: a free lock, none of the parent's events, ``seq``
        from 1, a sampler with nothing counted; the parent's file let go and returned (its
        settings open the child's own file, see ``core.state``)."""
        self._emit_lock = threading.RLock()
        self.memory.clear()
        self._seq = 0
        if self.sampler is not None:
            self.sampler = self.sampler.fresh()
        self.open_pending = None
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.after_fork_in_child()
        return sink

    def close(self) -> None:
        self.open_pending = None
        if self.sink is not None:
            self.flush_sampler()
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.close()

    def written_in_full(self, event: str, fields: dict) -> bool:
        """Whether a sampled event with these fields would be written whole (True when nothing
        samples it)."""
        sampler = self.sampler
        if sampler is None or not Sampler.applies("warning", event, fields):
            return True
        return sampler.written_in_full(event, fields)

    def flush_sampler(self, durable: bool = True) -> None:
        """Write the pending ``fused_calls`` / ``dense_calls`` counters (calls not yet covered
        by a record). ``durable=False`` (the periodic flusher): written, never fsync-ed."""
        sampler = self.sampler
        if sampler is None:
            return
        for event, fields in sampler.flush():
            self._log(COUNTER_LEVEL[event], event, fields, durable)

    def configure(
        self,
        max_events: int,
        sampler: Optional[Sampler],
        on_pending: Optional[Callable[[], None]] = None,
        on_sink_error: Optional[Callable[[BaseException], None]] = None,
        on_sink_resume: Optional[Callable[[int], None]] = None,
        mirror: Optional[Callable[[dict], None]] = None,
    ) -> None:
        """``enable()``'s settings: memory bound, a new sampler (the old one's pending counters
        are written first: nothing counted is lost), the sink's failure / recovery callbacks and
        the mirror (e.g. ``to_torch_trace``)."""
        self.set_max_events(max_events)
        self.flush_sampler()
        if sampler is not None:
            sampler.on_pending = on_pending
        self.sampler = sampler
        self.on_sink_error = on_sink_error
        self.on_sink_resume = on_sink_resume
        self.mirror = mirror

    def set_sink_options(self, fsync: Union[bool, str], max_bytes: Optional[int], backups: int) -> bool:
        """Change the open file's fsync and rotation settings in place (``enable()`` again, same
        file); True when ``fsync`` changed (what was written before was made durable, or not,
        under the old setting)."""
        sink = self.sink
        if sink is None:
            return False
        changed = sink.fsync != fsync
        sink.fsync = fsync
        sink.max_bytes = max_bytes or None
        sink.backups = backups
        return changed

    def set_max_events(self, n: int) -> None:
        if n != self.memory.maxlen:
            self.memory = collections.deque(self.memory, maxlen=n)

    def emit(self, level: str, event: str, durable: bool = True, **fields: Any) -> dict:
        """Log one event; returns the dict that was stored in memory ({} when sampled out).
        ``durable=False``: never fsync this one (see the module docstring)."""
        return self.emit_fields(level, event, fields, durable)

    def emit_fields(self, level: str, event: str, fields: dict, durable: bool = True) -> dict:
        sampler = self.sampler
        if sampler is not None:
            if event in FLUSH_BEFORE:
                self.flush_sampler()
            elif sampler.applies(level, event, fields):
                verdict = sampler.offer(event, fields)
                if verdict is None:
                    return {}
                if verdict is not KEEP:
                    return self._log(COUNTER_LEVEL[verdict[0]], verdict[0], verdict[1])
        return self._log(level, event, fields, durable)

    def _log(self, level: str, event: str, fields: dict, durable: bool = True) -> dict:
        if self.open_pending is not None:
            self._open_pending()
        # One lock around stamp, memory and write: seq numbers reach the file in order.
        with self._emit_lock:
            stored = self._bound.write(level, event, fields, durable and level in _DURABLE_LEVELS)
        mirror = self.mirror
        if mirror is not None and stored:
            mirror(stored)
        if stored and human_logger.isEnabledFor(logging.DEBUG):  # TORCH_LOGS=+fusionguard: every event
            human_logger.debug("fusionguard event: %s", _DumpLazily(stored))
        return stored if stored is not None else {}


class _DumpLazily:
    """An event rendered only if a handler formats the record."""

    __slots__ = ("event",)

    def __init__(self, event: dict) -> None:
        self.event = event

    def __str__(self) -> str:
        return dumps(self.event)


def _redact(logger: Any, method: str, event_dict: dict) -> dict:
    """Secrets out of every string of the event (a crash message, a traceback, Dynamo's evidence,
    a path): the file, the memory copy and the structured trace get the redacted text."""
    for k, v in event_dict.items():
        if v.__class__ is not int and v.__class__ is not float and v is not None and k not in _OWN_WORDS:
            event_dict[k] = redact_value(v)
    return event_dict


#: Fields whose value is always one of fusionguard's own words, never the program's text.
_OWN_WORDS = frozenset({"event", "level", "phase", "path", "cause", "action", "of", "source", "blocked_by", "mode", "template"})


def _render(logger: Any, method: str, event_dict: dict) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """The last processor: structlog's JSON renderer (today's lines: compact, UTF-8, ``str()`` for
    what JSON lacks) and the event itself, for memory and for ``emit()``'s return value."""
    return (_JSON(logger, method, event_dict),), {"event_dict": event_dict}


_JSON = structlog.processors.JSONRenderer(serializer=lambda obj, **_: dumps(obj))
#: ``ts``: seconds since the epoch, a float (``time.time()``), as the log has always had it.
_TIME = structlog.processors.TimeStamper(fmt=None, utc=True, key="ts")


class _LineWriter:
    """What fusionguard's bound logger wraps: the event log's memory and file."""

    __slots__ = ("_log",)

    def __init__(self, log: "EventLog") -> None:
        self._log = log

    def write(self, line: str, event_dict: dict, durable: bool) -> dict:
        return self._log._store(line, event_dict, durable)


class _Bound(structlog.BoundLoggerBase):
    """fusionguard's bound logger, by structlog's custom-wrapper protocol: one ``write`` that
    runs the chain on the caller's field dict (``_process_event`` copies it once, into the empty
    context) instead of a method per level, which would pack and copy the fields twice more
    (the dense path writes its first events through here)."""

    _logger: _LineWriter

    def write(self, level: str, event: str, fields: dict, durable: bool) -> Optional[dict]:
        try:
            args, kw = self._process_event(level, event, fields)
        except structlog.DropEvent:
            return None
        return self._logger.write(args[0], kw["event_dict"], durable)


_TRACE: Optional[Tuple[Any, Any]] = None  # (trace_log, trace_structured), imported on first use


def to_torch_trace(event: dict) -> None:
    """Put a verdict into PyTorch's structured trace (TORCH_TRACE), next to the compile that
    caused it, so tlparse shows it. A no-op unless the trace is on; never raises."""
    if event.get("event") not in TRACE_EVENTS:
        return
    try:
        global _TRACE
        if _TRACE is None:
            found = structured_trace()
            if found is None:
                return
            _TRACE = found  # one assignment: threads may race here
        trace_log, trace_structured = _TRACE
        if not trace_log.handlers:
            return
        name = f"fusionguard_{event['event']}"
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": name, "encoding": "json"},
            payload_fn=lambda: dumps(event),
        )
    except Exception:
        pass
