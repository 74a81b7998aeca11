"""Reading a faulthandler crash file (a segfault or abort inside PyTorch, where no Python hook
ran) into a ``crash`` record for ``fusionguard report``; opening files named by logs safely."""

from __future__ import annotations

import os
import re
import stat
from typing import Any, Dict, Iterable, List, Optional

from fusionguard.eventlog.diagnosis import DENSE_FUNCTIONS, MAX_MESSAGE, compact_flex, flex_text, last_flex
from fusionguard.eventlog.redact import redact_text

_SIGNALS = {
    "segmentation fault": "SIGSEGV",
    "aborted": "SIGABRT",
    "floating point exception": "SIGFPE",
    "bus error": "SIGBUS",
    "illegal instruction": "SIGILL",
}
#: The crash files ``native_crash`` read in this process (``report`` never writes over one).
CRASH_FILES_READ: List[str] = []
_FH_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+|\?\?\?) in (?P<name>.*)$')


def open_for_reading(path: str) -> Any:
    """Open for reading without blocking on a FIFO, and refuse what is not a regular file: the
    paths come from logs (``report``), and a FIFO or a device there would hang the reader."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(0, "not a regular file", path)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def native_crash(crash_file: Any, log_files: Iterable[str] = (), recent: Iterable[dict] = ()) -> Optional[Dict[str, Any]]:
    """A ``crash`` record (the fields of a Python crash event) from a faulthandler file, or None
    when there is none or it is empty. ``crash_file``: from the process's header (looked up
    beside ``log_files`` too, for logs copied elsewhere); ``recent``: the process's last events,
    oldest first, for the last FlexAttention event before the crash."""
    if not isinstance(crash_file, str) or not crash_file:
        return None

    candidates = [crash_file] + [os.path.join(os.path.dirname(f), os.path.basename(crash_file)) for f in log_files]
    for path in candidates:
        try:
            with open_for_reading(path) as fh:
                text = fh.read(256 * 1024).decode("utf-8", "replace")
            mtime: Optional[float] = os.path.getmtime(path)
            CRASH_FILES_READ.append(path)
            break
        except OSError:
            continue
    else:
        return None
    lines = text.splitlines()
    message = next((ln.strip() for ln in lines if "Fatal Python error" in ln), "")
    if not text.strip() or not message:
        return None
    lowered = message.lower()
    sig = next((name for words, name in _SIGNALS.items() if words in lowered), "fatal signal")
    start = next((i for i, ln in enumerate(lines) if ln.startswith("Current thread")), None)
    if start is None:
        start = next((i for i, ln in enumerate(lines) if ln.startswith("Thread ")), len(lines))
    frames: List[str] = []
    for ln in lines[start + 1 :]:
        m = _FH_FRAME.match(ln)
        if m is None:
            if ln.strip():
                break
            continue
        frames.append(redact_text(f"{m.group('file')}:{m.group('line')} in {m.group('name')}"))  # (written by faulthandler: never redacted)
    frames.reverse()  # faulthandler prints the innermost call first
    flex = last_flex(recent)
    in_dense = any(f.rsplit(" in ", 1)[-1] in DENSE_FUNCTIONS for f in frames)
    where = " inside FlexAttention's dense implementation" if in_dense else ""
    tail = f"; last FlexAttention event: {flex_text(flex)}" if flex else "; no FlexAttention event was recorded before it"
    return {
        "event": "crash",
        "ts": mtime,
        "exc_type": f"native crash ({sig})",
        "message": redact_text(message[:MAX_MESSAGE]),
        "where": "faulthandler",
        "thread": None,
        "last_flex": compact_flex(flex),
        "diagnosis": f"the process died of {sig}{where}{tail}",
        "frames": frames[-8:],
        "crash_file": redact_text(path),
    }
