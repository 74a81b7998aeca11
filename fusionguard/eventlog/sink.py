"""The log file: append-only JSON lines on a regular file, opened so nothing can redirect it.

Why its own module: durability lives here (one ``os.write`` per line on ``O_APPEND``, ``fsync``
for warnings, closing a torn last line, rotation by size with the header copied, ENOSPC fragments
closed before the next line); ``log.EventLog`` decides *what* to write, this decides *how*.

Rotation and several processes on one path (issue #27): without rotation, ``O_APPEND`` alone
makes sharing safe. With rotation, a writer must never append to a file that another process
has renamed away (it may be the oldest backup, removed next), must count the other processes'
lines in the size, and two processes must never shift the backups at once (one ``os.replace``
overwrites the other's file). So every write of a rotating sink holds ``flock`` on a lock file
beside the log (``<path>.lock``: it is never renamed, unlike the log, so one acquisition is
enough; a lock on the log file itself has to be taken again on each new file, and a writer can
be outrun there for ever), checks under it that its file is still the one at ``path`` (reopening
when another process rotated), rotates, and writes. A process killed while holding the lock
releases it. Its first line in a file another process started follows its own header copy, so
``report`` knows every line's host however many backups are pruned. A lock file removed while
held (an ``rm`` of the log's files) is noticed after ``flock`` (the path names another file, or
none) and the lock taken again on the file now there, so every process locks one file again.
A sink of one process (a file per process in a log directory: ``shared=False``) needs no lock.

The lock never hangs the program (issue #32): the lock file is opened read-only, so any reader of
the log can ``flock`` it, and a sibling stopped with Ctrl-Z or in a debugger holds it for good. A
write waits for it at most ``LOCK_WAIT_S``, once per process: past that, this write and every
later one of the process try ``LOCK_NB`` only and go on unlocked when it is busy (said once).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from typing import Callable, List, Optional, Union

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: rotation stays per process, as before
    fcntl = None  # type: ignore[assignment]

#: New log and crash files: readable by their owner only (``enable(log_mode=0o640)`` widens).
DEFAULT_LOG_MODE = 0o600

#: Lock files locked and found replaced (removed, recreated) before a write goes on unlocked.
_LOCK_TRIES = 8

#: The longest a write waits for another process's lock on ``<log>.lock``, once per process.
LOCK_WAIT_S = 2.0

# This process waited LOCK_WAIT_S once and gave up: its writes never wait again (LOCK_NB only).
_waited_out = False


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


def _flock(fd: int, lock: bool) -> bool:
    """Release ``fd``'s ``flock`` (``lock=False``), or take it within the bounded wait (see
    ``_lock_bounded``); False where there is no ``flock`` (Windows), the filesystem refuses it
    (some network filesystems) or it stayed busy: the write then goes on unlocked, still
    following rotations."""
    if fcntl is None:
        return False  # pragma: no cover - Windows
    if lock:
        return _lock_bounded(fd) is True
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        return False
    return True


def _lock_bounded(fd: int) -> Optional[bool]:
    """``flock`` ``fd`` exclusively, never blocking for long: True when locked; False where
    ``flock`` fails outright; None when another process held it past ``LOCK_WAIT_S`` (waited
    once per process: afterwards one ``LOCK_NB`` try, None when busy). A healthy holder is inside
    a few system calls, so the wait is a poll with short sleeps."""
    global _waited_out
    deadline = None
    delay = 0.0005
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except (BlockingIOError, PermissionError):  # busy (EWOULDBLOCK; EACCES on some systems)
            pass
        except OSError:
            return False
        if _waited_out:
            return None
        now = time.monotonic()
        if deadline is None:
            deadline = now + LOCK_WAIT_S
        if now >= deadline:
            _waited_out = True
            return None
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, 0.02)


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
        shared: bool = True,
    ) -> None:
        """``max_bytes``: rotate when the file would grow past it (None or 0: never);
        ``backups``: rotated files kept (``path.1`` newest ... ``path.N``; 0: the full file is
        removed); ``preamble``: returns this process's header copy, written before its first
        line in each file it did not open itself; ``mode``: permissions of a file this sink
        creates (an existing file keeps its own); ``shared``: other processes may write this
        path (False: a file of its own, rotated without the lock file)."""
        self.path = path
        self.fsync = fsync
        self.max_bytes = int(max_bytes) if max_bytes else None
        self.backups = max(0, int(backups))
        self.preamble = preamble
        self.mode = mode
        self.shared = shared
        self.rotations = 0
        self.unwritten = 0  # events whose write failed (disk full, ...): in memory only
        self._torn = False  # a failed write may have left part of a line: close it before the next
        self._fresh = False  # reopened (a rotation): its first write puts the header copy first
        self._lock_fd: Optional[int] = None  # <path>.lock, opened on the first rotating write
        self._lock_ident: tuple = ()  # (inode, device) of _lock_fd's file
        self._lock_failed = False  # for good: the lock path is a symlink or not a regular file
        self._told_unlocked = False
        self.lock_note: Optional[str] = None  # said once by the log (eventlog.log): writing without the busy lock
        self._lock = threading.Lock()
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        self._fd: Optional[int] = open_regular(path, mode)
        self._ident = self._file_ident()
        self._close_torn_line()
        self._size = self._file_size()

    def _file_ident(self) -> tuple:
        """(inode, device) of the open file: the path names it until someone rotates it."""
        try:
            st = os.fstat(self._fd) if self._fd is not None else None
        except OSError:
            st = None
        return (st.st_ino, st.st_dev) if st is not None else ()

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
            max_bytes = self.max_bytes
            if max_bytes is not None:
                self._write_rotating(data, max_bytes)
            else:
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

    # -- size-based rotation, safe for several processes on one path (under self._lock) ------
    def _write_rotating(self, data: bytes, max_bytes: int) -> None:
        """Append ``data`` under the lock file's ``flock`` (see the module docstring): follow
        another process's rotation, rotate when the file would grow past ``max_bytes`` (an
        empty file never: a header copy and one event larger than that share a file), put this
        process's header copy before its first line in a file it reopened (one it rotated to,
        or one another process started). The files let go of are fsync-ed and closed after the
        lock is released."""
        lock_fd = self._acquire()
        old: List[int] = []
        try:
            fd = self._fd
            at_path = self._at_path() if fd is not None else None
            if fd is None or at_path is None:  # rotated or removed by another process (or not reopened)
                fd = self._reopen(old)  # OSError: this event stays in memory; the next one tries again
                at_path = self._at_path()
            size = at_path.st_size if at_path is not None else os.fstat(fd).st_size
            head = self._preamble() if self._fresh else b""
            if size and size + len(head) + len(data) > max_bytes and self._rotate():
                size = os.fstat(self._reopen(old)).st_size
                head = self._preamble()
            if self._torn:
                self._write_bytes(b"\n")  # see write(): the fragment is ended first
                self._torn = False
                size += 1
            if head:
                self._write_bytes(head)
                size += len(head)
            self._fresh = False
            self._write_bytes(data)
            self._size = size + len(data)
        finally:
            if lock_fd is not None:
                _flock(lock_fd, False)
            for fd in old:
                try:
                    os.fsync(fd)  # it may be a backup now: what it holds is kept
                except OSError:
                    pass
                os.close(fd)

    def _acquire(self) -> Optional[int]:
        """``flock`` the lock file and return its descriptor; None: this write goes on
        unlocked (no lock file wanted or possible, no ``flock``). A lock file removed or
        replaced since it was opened locks nothing any more (a process started since locks the
        new one): it is let go and the file at the path opened and locked instead, a few times
        at most (someone removing it in a loop cannot hold a write up for ever)."""
        lockpath = self.path + ".lock"
        for _ in range(_LOCK_TRIES):
            fd = self._lock_file()
            if fd is None:
                return None
            got = _lock_bounded(fd) if fcntl is not None else False
            if got is None and not self._told_unlocked:
                self._told_unlocked = True
                self.lock_note = (
                    f"fusionguard: the log's lock file {lockpath!r} was held by another process for {LOCK_WAIT_S:g} s (a reader "
                    "of the log, or a writer that is stopped); this process writes the log without it from now on, never "
                    "waiting again (each line is still appended whole; rotation may race with the holder)"
                )
            if not got:
                return None
            try:
                now = os.stat(lockpath, follow_symlinks=False)
                if (now.st_ino, now.st_dev) == self._lock_ident:
                    return fd
            except FileNotFoundError:
                pass
            except OSError:
                return fd  # (cannot tell: keep the lock held)
            _flock(fd, False)
            self._close_lock()
        return None

    def _lock_file(self) -> Optional[int]:
        """The descriptor of ``<path>.lock`` (opened read-only, so whoever may read the log may
        lock it; created with the log's mode, never removed: removing a lock file races with its
        next user); None where it is not wanted (``shared=False``) or cannot be opened: rotation
        then goes on unlocked, as before. A symlink, FIFO or other non-regular file there is
        refused for good; any other failure (ENOSPC, EMFILE, EACCES) is tried again on the next
        write."""
        if self._lock_fd is None and self.shared and not self._lock_failed:
            try:
                fd = open_regular(self.path + ".lock", self.mode, flags=os.O_RDONLY)
            except OSError as exc:
                if exc.errno in (None, errno.ELOOP, errno.ENXIO):  # (None: open_regular's "not a regular file")
                    self._lock_failed = True
                return None
            try:
                st = os.fstat(fd)
            except OSError:
                os.close(fd)
                return None
            self._lock_fd, self._lock_ident = fd, (st.st_ino, st.st_dev)
        return self._lock_fd

    def _close_lock(self) -> None:
        fd, self._lock_fd, self._lock_ident = self._lock_fd, None, ()
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def _at_path(self) -> Optional[os.stat_result]:
        """The path's ``lstat`` while it still names the open file (one system call for both
        questions: rotated away? how big?), else None (never through a symlink)."""
        try:
            current = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return current if (current.st_ino, current.st_dev) == self._ident else None

    def _rotate(self) -> bool:
        """Rename ``path`` to ``path.1`` (under the lock file's lock), shifting the
        backups up to the first free number, so numbering stays contiguous and the oldest
        beyond ``backups`` is replaced; True when done. Best effort: on an error (a read-only
        directory) the file just grows."""
        try:
            if self.backups:
                free = next((i for i in range(1, self.backups) if not os.path.lexists(f"{self.path}.{i}")), self.backups)
                for i in range(free - 1, 0, -1):
                    os.replace(f"{self.path}.{i}", f"{self.path}.{i + 1}")
                os.replace(self.path, f"{self.path}.1")
            else:
                os.unlink(self.path)
        except OSError:
            return False
        self.rotations += 1
        return True

    def _reopen(self, old: List[int]) -> int:
        """Let go of the current file (into ``old``, fsync-ed and closed by the caller) and open
        the one at ``path``; this process's first line in it follows its header copy."""
        if self._fd is not None:
            old.append(self._fd)
            self._fd = None
        fd = self._fd = open_regular(self.path, self.mode)
        self._ident = self._file_ident()
        self._torn = False  # a fragment stays in the file it was written to
        self._fresh = True
        return fd

    def _preamble(self) -> bytes:
        """This process's header copy, encoded (empty where there is none)."""
        if self.preamble is None:
            return b""
        try:
            line = self.preamble()
        except Exception:
            line = None
        return (line + "\n").encode("utf-8", "replace") if line else b""

    def after_fork_in_child(self) -> None:
        """A forked child lets go of the parent's file and lock file: their descriptors closed
        (no fsync: the file is the parent's; a lock file shared with the parent would lock
        nothing between them), a free lock; the settings stay, for the child's own file. The
        child is a process of its own: it may wait for the lock once, too."""
        global _waited_out
        _waited_out = False
        self._told_unlocked = False
        self.lock_note = None
        self._lock = threading.Lock()
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = None
        self._close_lock()

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                try:
                    os.fsync(self._fd)
                except OSError:
                    pass
                os.close(self._fd)
                self._fd = None
            self._close_lock()
