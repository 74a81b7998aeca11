"""Crash-proof JSON-lines event log.

Why this shape:
- one ``os.write`` per event on an ``O_APPEND`` descriptor: a line is never interleaved with
  another thread's or process's line, and a process killed right after keeps every line it wrote
  (the data is in the kernel, not in a Python buffer);
- events at level ``warning`` and above (dense executions, errors) are also ``fsync``-ed before
  the caller goes on, so the record is on disk before the dense kernel allocates;
- a torn last line left by an earlier crash is closed with a newline before we append, so it can
  never swallow our first line;
- rendering goes through a private structlog logger (our own processors, never
  ``structlog.configure``): the host's structlog and ``logging`` setup stay theirs.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import sys
import threading
import time
from typing import Any, Callable, Deque, Optional

import structlog

SCHEMA_VERSION = 1

_DURABLE_LEVELS = frozenset({"warning", "error", "critical"})


def _json_default(obj: Any) -> Any:
    # torch.Size, dtypes, devices, sympy expressions, sets: readable, never a crash.
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)


def dumps(event: dict) -> str:
    return json.dumps(event, default=_json_default, separators=(",", ":"), ensure_ascii=False)


def rank_info() -> dict:
    """Rank, local rank and world size from torchrun's environment or torch.distributed."""

    def _int(name: str) -> Optional[int]:
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            return None

    rank, world = _int("RANK"), _int("WORLD_SIZE")
    if rank is None:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                rank, world = dist.get_rank(), dist.get_world_size()
        except Exception:  # pragma: no cover - defensive
            pass
    return {"rank": rank if rank is not None else 0, "local_rank": _int("LOCAL_RANK"), "world_size": world or 1}


class FileSink:
    """Append-only JSON-lines file. Thread-safe; safe to share between processes."""

    def __init__(self, path: str, fsync: bool = True) -> None:
        self.path = path
        self.fsync = fsync
        self._lock = threading.Lock()
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        self._fd: Optional[int] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._close_torn_line()

    def _close_torn_line(self) -> None:
        try:
            size = os.path.getsize(self.path)
            if size:
                with open(self.path, "rb") as fh:
                    fh.seek(size - 1)
                    if fh.read(1) != b"\n":
                        self._write_bytes(b"\n")
        except OSError:
            pass

    def _write_bytes(self, data: bytes) -> None:
        fd = self._fd
        if fd is None:
            return
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]

    def write(self, line: str, durable: bool) -> None:
        data = (line + "\n").encode("utf-8", "replace")
        with self._lock:
            self._write_bytes(data)
            if durable and self.fsync and self._fd is not None:
                os.fsync(self._fd)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                try:
                    os.fsync(self._fd)
                except OSError:
                    pass
                os.close(self._fd)
                self._fd = None


class _SinkLogger:
    """The 'logger' at the end of our structlog chain: it receives the rendered JSON line."""

    def __init__(self, log: "EventLog") -> None:
        self._log = log

    def _emit(self, level: str) -> Callable[[str], None]:
        def emit(line: str) -> None:
            self._log._write_line(line, level in _DURABLE_LEVELS)

        return emit

    def __getattr__(self, name: str) -> Callable[[str], None]:
        return self._emit(name)


class EventLog:
    """Events in memory (bounded) and, optionally, in a JSON-lines file."""

    def __init__(self, max_events: int = 10_000) -> None:
        self._lock = threading.Lock()
        self._seq = 0
        self.memory: Deque[dict] = collections.deque(maxlen=max_events)
        self.sink: Optional[FileSink] = None
        self._sink_failed = False
        self.on_sink_error: Optional[Callable[[BaseException], None]] = None
        self._logger = structlog.wrap_logger(
            _SinkLogger(self),
            processors=[
                structlog.contextvars.merge_contextvars,
                self._stamp,
                self._remember,
                structlog.processors.JSONRenderer(serializer=lambda obj, **_: dumps(obj)),
            ],
            wrapper_class=structlog.BoundLogger,
            context_class=dict,
            cache_logger_on_first_use=False,
        )

    # -- structlog processors -------------------------------------------------------------
    def _stamp(self, logger: Any, method: str, event_dict: dict) -> dict:
        with self._lock:
            self._seq += 1
            seq = self._seq
        stamped = {"event": event_dict.pop("event", None), "level": method, "ts": time.time(), "seq": seq}
        stamped.update(event_dict)
        stamped.setdefault("pid", os.getpid())
        if "rank" not in stamped:
            stamped["rank"] = rank_info()["rank"]
        stamped.setdefault("thread", threading.current_thread().name)
        return stamped

    def _remember(self, logger: Any, method: str, event_dict: dict) -> dict:
        self.memory.append(dict(event_dict))
        return event_dict

    # -- output -----------------------------------------------------------------------------
    def _write_line(self, line: str, durable: bool) -> None:
        sink = self.sink
        if sink is None:
            return
        try:
            sink.write(line, durable)
        except OSError as exc:  # disk full, file removed, ...: keep going in memory
            if not self._sink_failed:
                self._sink_failed = True
                if self.on_sink_error is not None:
                    self.on_sink_error(exc)

    def open(self, path: str, fsync: bool) -> None:
        self.close()
        self.sink = FileSink(path, fsync=fsync)
        self._sink_failed = False

    def close(self) -> None:
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.close()

    def set_max_events(self, n: int) -> None:
        if n != self.memory.maxlen:
            self.memory = collections.deque(self.memory, maxlen=n)

    def emit(self, level: str, event: str, **fields: Any) -> dict:
        """Log one event; returns the dict that was stored in memory."""
        getattr(self._logger, level)(event, **fields)
        return self.memory[-1] if self.memory else {}


def header_fields(patched: list, not_patched: dict, config: dict) -> dict:
    """Versions and environment, written first in every log file."""
    import torch

    from ._version import __version__

    try:
        import triton  # type: ignore

        triton_version = getattr(triton, "__version__", None)
    except Exception:
        triton_version = None
    cuda: dict = {"available": False}
    try:
        if torch.cuda.is_available():
            # device_count() does not create a CUDA context; names need one, so only when the
            # program already initialised CUDA (never grab memory on every rank's GPU 0).
            cuda = {"available": True, "count": torch.cuda.device_count(), "version": torch.version.cuda}
            if torch.cuda.is_initialized():
                cuda["devices"] = [torch.cuda.get_device_name(i) for i in range(cuda["count"])]
    except Exception:
        pass
    info = rank_info()
    return {
        "schema": SCHEMA_VERSION,
        "fusionguard": __version__,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": sys.version.split()[0],
        "hostname": socket.gethostname(),
        "argv": list(sys.argv),
        "cuda": cuda,
        "local_rank": info["local_rank"],
        "world_size": info["world_size"],
        "patched": patched,
        "not_patched": not_patched,
        "config": config,
    }
