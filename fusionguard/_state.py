"""Global state department: one private object, one lock, a reset for tests."""

from __future__ import annotations

import contextvars
import sys
import threading
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Set, Tuple, Union

from .log import EventLog
from .patches import PatchRegistry


@dataclass
class Config:
    strict: bool = False
    log_path: Optional[str] = None  # resolved absolute path, or None for memory only
    # True: the first dense event of each (call site, layer, phase, action) and every error are
    # fsync-ed before the dense kernel runs; "always": every dense event; False: none.
    fsync: Union[bool, str] = True
    max_events: int = 10_000  # events kept in memory for fusionguard.events()
    rescue: bool = False  # compile eager FlexAttention calls with Inductor instead of running dense
    fused_first: int = 10  # fused per-call events kept per (layer, phase) before sampling
    fused_every: int = 1000  # then one fused_calls counter event every N calls
    dense_first: int = 10  # dense events kept per (call site, layer, phase, cause, action) before sampling
    dense_every: int = 1000  # then one dense_calls counter event every N calls
    keep_all: bool = False  # keep every per-call event, fused and dense
    log_max_bytes: Optional[int] = None  # size-based rotation of the log file
    log_backups: int = 3

    def __post_init__(self) -> None:
        if self.fsync != "always" and not isinstance(self.fsync, bool):
            raise TypeError(f"fusionguard.enable(): fsync must be True, False or 'always', not {self.fsync!r}")
        for name in ("strict", "rescue", "keep_all"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"fusionguard.enable(): {name} must be True or False, not {getattr(self, name)!r}")
        for name, low in (("max_events", 1), ("fused_first", 0), ("fused_every", 0), ("dense_first", 1), ("dense_every", 0), ("log_backups", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"fusionguard.enable(): {name} must be an integer >= {low}, not {value!r}")
        if self.log_max_bytes is not None and (not isinstance(self.log_max_bytes, int) or self.log_max_bytes < 1024):
            raise ValueError(f"fusionguard.enable(): log_max_bytes must be None or an integer >= 1024, not {self.log_max_bytes!r}")

    def public(self) -> Dict[str, Any]:
        return asdict(self)


OPTIONS = (
    "fsync", "max_events", "rescue", "fused_first", "fused_every", "dense_first", "dense_every", "keep_all", "log_max_bytes", "log_backups",
)


class State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.enabled = False
        self.config = Config()
        self.log = EventLog(self.config.max_events)
        self.patches = PatchRegistry()
        self.not_patched: Dict[str, str] = {}
        self.reported: Set[Tuple[str, str]] = set()
        self.announced_path: Optional[str] = None
        self.atexit_registered = False
        self.counts: Dict[str, int] = {}
        # dense-event keys already fsync-ed to the current log file (see guard._check_dense)
        self.durable_keys: Set[tuple] = set()
        self.signal_hooks: list = []
        # threads currently inside allow_dense(): lets a backward that PyTorch runs on its own
        # autograd device thread (CUDA) see a block opened by the thread that called backward().
        self.allow_threads: Dict[int, int] = {}


STATE = State()

# True inside ``allow_dense()`` (per thread / task, via contextvars).
ALLOW_DENSE: contextvars.ContextVar[bool] = contextvars.ContextVar("fusionguard_allow_dense", default=False)


_COUNT_LOCK = threading.Lock()


def count(key: str, n: int = 1) -> None:
    with _COUNT_LOCK:
        STATE.counts[key] = STATE.counts.get(key, 0) + n


def write_stderr(text: str) -> None:
    """stderr may be None (pythonw, daemons) or closed: our messages must never fail."""
    try:
        if sys.stderr is not None:
            sys.stderr.write(text)
    except Exception:
        pass


def internal_error(where: str, exc: BaseException) -> None:
    """Record an unexpected failure inside fusionguard once; never raises."""
    try:
        key = (where, type(exc).__name__)
        if key in STATE.reported:
            return
        STATE.reported.add(key)
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        write_stderr(
            f"fusionguard: internal error in {where} (ignored; PyTorch runs unchanged): "
            f"{type(exc).__name__}: {exc}\n"
        )
        STATE.log.emit("error", "internal_error", where=where, error=f"{type(exc).__name__}: {exc}", traceback=tb)
    except Exception:
        pass


def reset_for_tests() -> None:
    """Forget everything (patches must already be removed)."""
    STATE.log.close()
    new = State()
    STATE.__dict__.update(new.__dict__)
    from .layers import STATS

    STATS.__init__()
