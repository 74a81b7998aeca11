"""The log file: append-only JSON lines on a regular file, opened so nothing can redirect it.

Why its own module: durability lives here (one ``os.write`` per line on ``O_APPEND``, ``fsync``
for warnings, closing a torn last line, rotation by size with the header copied, ENOSPC fragments
closed before the next line); ``log.EventLog`` decides *what* to write, this decides *how*.
"""

from __future__ import annotations

import os
import stat
import threading
from typing import Callable, Optional, Union

#: New log and crash files: readable by their owner only (``enable(log_mode=0o640)`` widens).
DEFAULT_LOG_MODE = 0o600


def open_regular(path: str, mode: int = DEFAULT_LOG_MODE, flags: int = os.O_WRONLY | os.O_APPEND) -> int:
    """Open (creating with ``mode``) a regular file for appending, never through a symlink and
    never blocking: a planted symlink fails with ELOOP, a FIFO without a reader with ENXIO, and
    any other non-regular file (FIFO with a reader, device, socket) is closed again and refused
    with an ``OSError``. Existing files keep their mode. The descriptor is close-on-exec."""
    extra = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags | os.O_CREAT | extra, mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path!r} is not a regular file (refused: a log is only appended to a regular file)")
        if getattr(os, "O_NONBLOCK", 0):
            os.set_blocking(fd, True)  # a regular file: O_NONBLOCK was only for the open itself
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_at(fd: int, offset: int) -> bytes:
    if hasattr(os, "pread"):
        return os.pread(fd, 1, offset)
    os.lseek(fd, offset, os.SEEK_SET)  # pragma: no cover - Windows
    return os.read(fd, 1)


class FileSink:
    """Append-only JSON-lines file. Thread-safe; safe to share between processes."""

    def __init__(
        self,
        path: str,
        fsync: Union[bool, str] = True,  # (True or "always": fsync durable events)
        max_bytes: Optional[int] = None,
        backups: int = 3,
        preamble: Optional[Callable[[], Optional[str]]] = None,
        mode: int = DEFAULT_LOG_MODE,
    ) -> None:
        """``max_bytes``: rotate when the file would grow past it (None or 0: never);
        ``backups``: rotated files kept (``path.1`` newest ... ``path.N``; 0: the full file is
        removed); ``preamble``: returns the line (a header copy) that starts each new file;
        ``mode``: permissions of a file this sink creates (an existing file keeps its own)."""
        self.path = path
        self.fsync = fsync
        self.max_bytes = int(max_bytes) if max_bytes else None
        self.backups = max(0, int(backups))
        self.preamble = preamble
        self.mode = mode
        self.rotations = 0
        self.unwritten = 0  # events whose write failed (disk full, ...): in memory only
        self._torn = False  # a failed write may have left part of a line: close it before the next
        self._lock = threading.Lock()
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        self._fd: Optional[int] = open_regular(path, mode)
        self._close_torn_line()
        self._size = self._file_size()

    def _file_size(self) -> int:
        try:
            return os.fstat(self._fd).st_size if self._fd is not None else 0
        except OSError:
            return 0

    def _close_torn_line(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            return
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_size and _read_at(fd, st.st_size - 1) != b"\n":
                self._write_bytes(b"\n")
        except OSError:
            pass
        finally:
            os.close(fd)

    def _write_bytes(self, data: bytes) -> None:
        fd = self._fd
        if fd is None:
            raise OSError("the log file is closed (it could not be reopened after a rotation)")
        view = memoryview(data)
        while view:
            try:
                n = os.write(fd, view)
            except OSError:
                if len(view) < len(data):
                    self._torn = True  # part of this line is in the file
                raise
            view = view[n:]

    def write(self, line: str, durable: bool) -> None:
        data = (line + "\n").encode("utf-8", "replace")
        with self._lock:
            if self.max_bytes is not None and self._size + len(data) > self.max_bytes:
                self._rotate_if_needed(len(data))
            if self._torn:
                # A short write (disk full) left a fragment: end it with its own newline first,
                # or this event would be glued onto it and both lines lost. If that fails, the
                # fragment is still open and this event is not written either.
                self._write_bytes(b"\n")
                self._torn = False
            self._write_bytes(data)
            self._size += len(data)
            if durable and self.fsync and self._fd is not None:
                os.fsync(self._fd)

    # -- size-based rotation (under self._lock) ----------------------------------------------
    def _rotate_if_needed(self, incoming: int) -> None:
        fd = self._fd
        if fd is None or self.max_bytes is None:
            return
        try:
            mine = os.fstat(fd)
            self._size = mine.st_size  # other processes may append to the same file
            if self._size == 0 or self._size + incoming <= self.max_bytes:
                return
            try:
                current = os.stat(self.path)
            except FileNotFoundError:
                current = None
            if current is None or (current.st_ino, current.st_dev) != (mine.st_ino, mine.st_dev):
                # Another process sharing this file rotated it already: follow it.
                self._reopen()
                return
            if self.backups:
                for i in range(self.backups - 1, 0, -1):
                    src = f"{self.path}.{i}"
                    if os.path.exists(src):
                        os.replace(src, f"{self.path}.{i + 1}")
                os.replace(self.path, f"{self.path}.1")
            else:
                os.unlink(self.path)
            self.rotations += 1
            self._reopen()
        except OSError:
            return  # rotation is best effort: keep appending to the file we have

    def _reopen(self) -> None:
        old, self._fd = self._fd, None
        if old is not None:
            try:
                os.fsync(old)
            except OSError:
                pass
            os.close(old)
        self._fd = open_regular(self.path, self.mode)
        self._torn = False  # a fragment stays in the file it was written to
        self._size = self._file_size()
        if self._size == 0 and self.preamble is not None:
            try:
                line = self.preamble()
            except Exception:
                line = None
            if line:
                data = (line + "\n").encode("utf-8", "replace")
                self._write_bytes(data)
                self._size += len(data)

    def after_fork_in_child(self) -> None:
        """A forked child lets go of the parent's file: its descriptor closed (no fsync: the
        file is the parent's), a free lock; the settings stay, for the child's own file."""
        self._lock = threading.Lock()
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                try:
                    os.fsync(self._fd)
                except OSError:
                    pass
                os.close(self._fd)
                self._fd = None
