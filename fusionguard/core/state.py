"""Global state department: one private object, one lock, one ``reset()``; the periodic
counter flusher; what a forked child does to start clean (``os.register_at_fork``)."""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import sys
import threading
import traceback
import types
from multiprocessing import util
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Type, TypeVar, cast

from fusionguard.core.config import Config, Runtime, RuntimeRef, process_log_name
from fusionguard.core.registry import PatchRegistry
from fusionguard.core.tables import Caches, SessionRegistry, Stats, WatchRegistry
from fusionguard.eventlog import crash
from fusionguard.eventlog.header import header_fields
from fusionguard.eventlog.log import EventLog
from fusionguard.eventlog.messages import say
from fusionguard.eventlog.sink import FileSink

_F = TypeVar("_F", bound=Callable[..., Any])


# -- bounded loss of counts: the flusher ---------------------------------------------------------


class Flusher:
    """Writes the sampler's pending counters ``interval`` seconds after a call was counted and
    not written, so a process that is killed (SIGKILL, ``os._exit``, the OOM killer) loses at
    most the counts of its last interval. A daemon thread, started on the first pending count,
    asleep while nothing is pending; it writes through the log like any event (no fsync: the
    line is in the kernel, which is what survives a killed process). Nothing per fused call:
    the sampler calls ``poke()`` only when "nothing pending" turns into "something pending"."""

    def __init__(self) -> None:
        self.interval = 0.0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def configure(self, interval: float) -> None:
        self.interval = float(interval)
        if not self.interval:
            self.stop()

    def poke(self) -> None:
        if not self.interval:
            return
        self._wake.set()
        thread = self._thread
        if thread is None or not thread.is_alive():
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    self._stop.clear()
                    self._thread = threading.Thread(target=self._run, name="fusionguard-flusher", daemon=True)
                    self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        thread = self._thread
        self._stop.set()
        self._wake.set()
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout)
        self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            if self._stop.wait(self.interval) or self._stop.is_set():
                return
            self._wake.clear()
            with guarded("counter flusher"):
                if STATE.enabled:
                    STATE.log.flush_sampler(durable=False)

    def after_fork_in_child(self) -> None:
        """Threads do not survive fork: forget the parent's, start ours on the next poke."""
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = None


class State:
    """Every piece of fusionguard's process-wide mutable state, reachable from ``STATE``.

    Rebuilt by ``reset()``: config, log, patch registry, counts and the bookkeeping of enable().
    Long-lived, reset in place (modules may hold them): ``stats`` (per-layer rows),
    ``watch`` (watch()'s registry), ``sessions`` (the running sessions of ``track()``),
    ``caches`` (the dense path's), ``runtime`` (the holder the installed wrappers close over:
    ``runtime.now`` is the ``Runtime`` settings object of the current ``enable()``, swapped whole,
    the defaults after ``disable()`` and ``reset()``). Referenced, never reset here:
    ``crash`` (the excepthooks, SIGTERM handler and faulthandler file: let go of by their
    entries in the patch registry, or ``crash.uninstall()`` / ``release_native()``).

    Per thread or per context by design, so module-level, not here: the ContextVars
    ``_ALLOW_DENSE`` (this module), ``guard._FORWARD_SLOT`` / ``_BACKWARD_ORIGIN`` / ``_INLINED``,
    ``rescue.RESCUING``, ``watching.naming.LAYER``, ``watching.memory.OPEN``; the
    threading.locals ``watching.naming._BW_OPEN``, ``watching.hooks._FRAMES``,
    ``inductor._TL``, ``crash._in_hook``. Locks re-created in a forked child: see
    ``_locks_after_fork``. Looked-up-once constants of the torch release (``torch_internals``,
    ``dynamo_signals._TORCH_DIR``, ``log._TRACE``, ``masks._fix``; ``masks._limits``, each
    device's memory) are facts of the process, not state; so are
    counters that only hand out unique numbers (``guard._TOKENS``, ``watching.memory._ORDER``),
    the wrappers built at install (``guard._WRAPPERS``), the weak marks of allowed forwards'
    results (``guard._ALLOWED_FORWARDS``: they live and die with those tensors) and the
    activation notes said once per process (``activate._told``).
    """

    def __init__(self) -> None:
        self.watch = WatchRegistry()
        self.stats = Stats(self.watch.names)
        self.sessions = SessionRegistry()
        self.caches = Caches()
        self.runtime = RuntimeRef()
        self.crash = crash.CRASH
        self._fresh()

    def _fresh(self) -> None:
        self.lock = threading.RLock()
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
        self.log_dir: Optional[str] = None  # log_path was a directory: one file per process in it
        # who made the running settings: "program" (its own enable()), "launcher" (FUSIONGUARD=,
        # fusionguard run) or "session" (fusionguard.track()): the sessions' rule (session.py)
        self.enabled_by: Optional[str] = None
        self.crash_fields: Dict[str, Any] = {}  # crash_capture / crash_file, for the header
        self.flusher = Flusher()

    @property
    def enabled(self) -> bool:
        """``is_enabled()``: the running ``Runtime``'s (``runtime.now``); the per-call wrappers read
        ``runtime.now`` themselves, once, and this flag with the settings."""
        return self.runtime.now.enabled

    def reset(self, child: bool = False) -> None:
        """Forget everything (patches must already be removed): a fresh config, log and patch
        registry; stats, watch registry and caches emptied in place.

        ``child``: a forked child's start, enabled state and patches kept (they are its own
        copies): it forgets only what the parent counted and reported (the log forgets what the
        parent wrote: ``EventLog.after_fork_in_child``), and keeps the watch registry (its
        modules are the parent's, alive in the child too) and the caches."""
        if child:
            self.counts = {}
            self.durable_keys = set()
            self.reported = set()
            self.stats.rows = {}  # the parent's per-layer counts are the parent's
            return
        self.flusher.stop()
        self.log.close()
        self._fresh()
        self.stats.reset()
        self.watch.reset()
        self.sessions.reset()
        self.caches.reset()
        self.runtime.now = Runtime()


STATE = State()


class Allowance:
    """One open ``allow_dense()`` block: ``_ALLOW_DENSE`` holds the innermost one of the context.

    Closed by flipping ``open`` at the block's exit, never by resetting a context-variable token:
    an asyncio block may end in another context (an async yield fixture's teardown), where a
    token cannot be reset; a closed block then allows nothing in any context that still holds it.
    ``frame``: the generator frame the block belongs to when a generator that user code iterates
    opened it (issue #32): it allows only while that frame is on the calling stack, never the
    consumer's code between the generator's yields; None for every other block.
    """

    __slots__ = ("open", "outer", "frame")
    open: bool
    outer: Optional["Allowance"]
    frame: Optional[types.FrameType]

    def __init__(self, outer: Optional["Allowance"], frame: Optional[types.FrameType] = None) -> None:
        while outer is not None and not outer.open:  # (a closed block's place is its outer's)
            outer = outer.outer
        self.open = True
        self.outer = outer
        self.frame = frame


# The innermost allow_dense() block of this thread / task (contextvars: a thread, or an asyncio
# task, sees only the blocks it entered or inherited in a copied context; see dense_allowed_here).
# Private: its value stays truthy after its block closes, so ``if _ALLOW_DENSE.get():`` would be a
# strict-mode bypass. Read it only through ``dense_allowed_here()``; change it only through
# ``open_allowance`` / ``close_allowance`` (tests/test_wiring.py checks that no other module does).
_ALLOW_DENSE: contextvars.ContextVar[Optional[Allowance]] = contextvars.ContextVar("fusionguard_allow_dense", default=None)

_GENERATOR_FLAGS = 0x20 | 0x200  # inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR (not importing inspect)
# What drives a generator as a context manager (a fixture, a hookwrapper), not as an iterator:
# a block opened in such a generator covers the code inside its ``with``, as a plain block does.
# contextlib (contextmanager, asynccontextmanager, ExitStack), pytest's fixtures, pluggy's
# hookwrappers, and the runners of async yield fixtures (asyncio's tasks and loop stepping an
# ``anext()`` directly, pytest-asyncio, anyio's pytest plugin). Anything else resuming a
# generator is iteration: the block is the generator's own (the strict side, when in doubt).
_DRIVERS = ("contextlib", "_pytest", "pluggy", "asyncio", "pytest_asyncio", "anyio")


def _drives_as_context_manager(frame: Optional[types.FrameType]) -> bool:
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return isinstance(name, str) and name.split(".", 1)[0] in _DRIVERS


def _owning_generator(frame: Optional[types.FrameType]) -> Optional[types.FrameType]:
    """The generator frame that a block entered from ``frame`` (the frame that resumed
    ``allow_dense()``'s own generator) belongs to, or None: walk out through contextlib's frames
    and generators driven as context managers; the first other frame owns the block, and it
    counts when it is a (sync or async) generator that something else than a driver resumed."""
    while frame is not None:
        if frame.f_globals.get("__name__") == "contextlib":
            frame = frame.f_back
            continue
        if not frame.f_code.co_flags & _GENERATOR_FLAGS:
            return None
        if not _drives_as_context_manager(frame.f_back):
            return frame
        frame = frame.f_back
    return None


def _on_stack(frame: types.FrameType) -> bool:
    f: Optional[types.FrameType] = sys._getframe(2)
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False


def dense_allowed_here() -> bool:
    """True inside an open ``allow_dense()`` block of this context: the one test of an allowance.
    (A generator's block: only while that generator's own code runs; the stack walk is paid only
    by a dense call while such a block is open, never on the fused path.)"""
    block = _ALLOW_DENSE.get()
    while block is not None:
        if block.open and (block.frame is None or _on_stack(block.frame)):
            return True
        block = block.outer
    return False


def open_allowance(entered_from: Optional[types.FrameType] = None) -> Allowance:
    """``allow_dense()``'s entry: a new innermost block in this context. ``entered_from``: the
    frame that resumed ``allow_dense()``'s generator (``contextlib``'s ``__enter__``)."""
    block = Allowance(_ALLOW_DENSE.get(), _owning_generator(entered_from))
    _ALLOW_DENSE.set(block)
    return block


def close_allowance(block: Allowance) -> None:
    """``allow_dense()``'s exit, in whatever context it runs: the block is closed in every
    context that holds it; this context goes back to what was outside it when the block (or a
    block inside it, closed elsewhere) is its innermost."""
    block.open = False
    block.frame = None  # (a frame holds its locals: not kept past the block)
    inner = _ALLOW_DENSE.get()
    while inner is not None and not inner.open:
        if inner is block:
            _ALLOW_DENSE.set(block.outer)
            break
        inner = inner.outer


_COUNT_LOCK = threading.Lock()


def count(key: str, n: int = 1) -> None:
    with _COUNT_LOCK:
        STATE.counts[key] = STATE.counts.get(key, 0) + n


def emit(level: str, event: str, **fields: Any) -> dict:
    """``STATE.log.emit``, for callbacks kept across a test's reset (which replaces ``STATE.log``)."""
    return STATE.log.emit(level, event, **fields)


def write_stderr(text: str, level: int = logging.WARNING) -> None:
    """A human message, through ``logging.getLogger("fusionguard")`` (see ``eventlog.messages``): on
    stderr exactly as written unless the user routed or silenced that logger. Never raises."""
    say(text, level)


def nothing() -> None:
    """None, whatever is asked: a weak reference that holds nothing (``ref = nothing``), an empty body."""
    return None


def internal_error(where: str, exc: BaseException) -> None:
    """Record an unexpected failure inside fusionguard once; never raises."""
    try:
        key = (where, type(exc).__name__)
        if key in STATE.reported:
            return
        STATE.reported.add(key)
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        write_stderr(
            f"fusionguard: internal error in {where} (ignored; PyTorch runs unchanged): {type(exc).__name__}: {exc}\n",
            logging.ERROR,
        )
        STATE.log.emit("error", "internal_error", where=where, error=f"{type(exc).__name__}: {exc}", traceback=tb)
    except Exception:
        pass


class guarded:
    """An unexpected error in fusionguard's own work, logged once (``internal_error``) and
    swallowed so the host program goes on: ``with guarded("what"):`` around a block, or
    ``@guarded("what", fallback=value)`` on a function, which then returns ``fallback`` (shared
    by every call: an immutable value). Only ``Exception`` is caught: ``BaseException``
    (KeyboardInterrupt, SystemExit) propagates, and so do the types in ``passes`` (the strict-mode
    ``DenseFallbackError`` where the block may raise it on purpose).

    Not for the per-call paths: a ``with`` costs about 0.1 us when nothing raises and the
    decorator one more call, where a plain ``try``/``except`` costs nothing (CPython 3.11). A
    graph run, a watched layer's hooks and the dense kernel's wrapper keep theirs."""

    __slots__ = ("where", "fallback", "passes")

    def __init__(self, where: str, fallback: Any = None, passes: Tuple[Type[BaseException], ...] = ()) -> None:
        self.where = where
        self.fallback = fallback
        self.passes = passes

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Optional[type], exc: Optional[BaseException], tb: Any) -> bool:
        if kind is None or exc is None or not issubclass(kind, Exception) or issubclass(kind, self.passes):
            return False
        internal_error(self.where, exc)
        return True

    def __call__(self, fn: _F) -> _F:
        where, fallback, passes = self.where, self.fallback, self.passes

        @functools.wraps(fn)
        def safe(*args: Any, **kwargs: Any) -> Any:
            try:  # (guarded() itself, as a decorator)
                return fn(*args, **kwargs)
            except passes:
                raise
            except Exception as exc:
                internal_error(where, exc)
                return fallback

        return cast(_F, safe)


# -- fork safety ------------------------------------------------------------------------------------


def _reinit(lock: Any) -> Any:
    """A lock as the child must see it: free (the thread holding it in the parent does not exist
    here). ``_at_fork_reinit`` is what CPython's logging uses; a fresh lock where it is missing."""
    fresh = getattr(lock, "_at_fork_reinit", None)
    if fresh is not None:
        fresh()
        return lock
    return type(lock)()


def _locks_after_fork() -> None:
    global _COUNT_LOCK
    STATE.lock = _reinit(STATE.lock)
    _COUNT_LOCK = _reinit(_COUNT_LOCK)
    STATE.patches.after_fork_in_child()
    STATE.crash.after_fork_in_child()
    STATE.watch.lock = _reinit(STATE.watch.lock)
    STATE.sessions.lock = _reinit(STATE.sessions.lock)
    STATE.stats.lock = _reinit(STATE.stats.lock)
    for reinit in _CHILD_LOCKS:
        reinit(_reinit)


#: Upper layers' locks to re-create in a forked child (``dense.dynamo_signals``): each is called with
#: ``_reinit`` and replaces its lock (registered at their import: the state imports none of them).
_CHILD_LOCKS: List[Callable[[Callable[[Any], Any]], None]] = []


def on_fork_reinit(fn: Callable[[Callable[[Any], Any]], None]) -> None:
    """Register ``fn(reinit)``: it replaces a lock of its own with ``reinit(lock)`` in a forked child."""
    _CHILD_LOCKS.append(fn)


def _after_fork_in_child() -> None:
    """The child starts clean: free locks, no parent counts (they are the parent's to write),
    its own events in memory, its own file (directory mode) and crash file, opened when it logs
    its first event (a DataLoader worker that never calls FlexAttention leaves nothing behind)."""
    with guarded("after fork (child)"):  # never break the child
        _locks_after_fork()
        STATE.flusher.after_fork_in_child()
        parent_sink = STATE.log.after_fork_in_child()
        STATE.reset(child=True)
        crash.release_native(after_fork=True)
        if parent_sink is not None and STATE.enabled:
            STATE.log.open_pending = lambda: _open_child_log(parent_sink)


def _open_child_log(parent_sink: Any) -> None:
    """Called (under the log's lock) with the forked child's first event. Never raises."""
    try:
        _open_child_log_now(parent_sink)
    except Exception as exc:
        write_stderr(
            f"fusionguard: forked process {os.getpid()} could not start its own log ({type(exc).__name__}: {exc}); "
            "its events are kept in memory only\n"
        )


def _open_child_log_now(parent_sink: Any) -> None:
    config = STATE.config
    path = parent_sink.path
    if STATE.log_dir is not None:
        path = os.path.join(STATE.log_dir, process_log_name())
        config.log_path = path
    try:
        STATE.log.attach(
            FileSink(
                path,
                fsync=parent_sink.fsync,
                max_bytes=parent_sink.max_bytes,
                backups=parent_sink.backups,
                preamble=STATE.log.header_copy,
                mode=config.log_mode,
                shared=STATE.log_dir is None,
            )
        )
    except OSError as exc:
        write_stderr(
            f"fusionguard: forked process {os.getpid()} cannot open its log {path!r} ({exc}); its events are kept in memory only\n"
        )
        return
    STATE.crash_fields = crash.capture_native(path, config.log_mode)
    fields = header_fields(STATE.patches.names(), dict(STATE.not_patched), config.public())
    fields.update(STATE.crash_fields, forked_from=os.getppid())
    STATE.log.emit("info", "header", **fields)


_FORK_HELD = False  # the forking thread took STATE.lock in _before_fork


def _before_fork() -> None:
    """Wait (bounded) for an enable() / disable() of another thread to finish, so the child never
    starts with half-applied patches or a half-built config."""
    global _FORK_HELD
    try:
        _FORK_HELD = STATE.lock.acquire(timeout=5.0)
    except Exception:
        _FORK_HELD = False


def _after_fork_in_parent() -> None:
    global _FORK_HELD
    if _FORK_HELD:
        _FORK_HELD = False
        try:
            STATE.lock.release()
        except Exception:
            pass


def _after_fork_in_child_hook() -> None:
    global _FORK_HELD
    _FORK_HELD = False  # the lock is re-initialised (free) in the child
    _after_fork_in_child()


# os.register_at_fork has no undo: registered once at import, the hooks do nothing while disabled.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child_hook)


# -- multiprocessing workers (DataLoader's): they end with os._exit, after util._exit_function ----


def _worker_exit() -> None:
    """A multiprocessing child is ending: its last counters, summary and shutdown, as atexit
    would write them (``os._exit`` follows, so atexit never runs)."""
    if _AT_WORKER_EXIT is not None:
        _AT_WORKER_EXIT()


#: What a multiprocessing worker runs as it ends: ``_lifecycle.at_exit``, registered by ``_lifecycle``
#: at its import (the state sits below it and imports nothing of it).
_AT_WORKER_EXIT: Optional[Callable[[], None]] = None


def on_worker_exit(fn: Callable[[], None]) -> None:
    global _AT_WORKER_EXIT
    _AT_WORKER_EXIT = fn


def _worker_started(_state: Any) -> None:
    """Run in a multiprocessing child after its finalizer registry was cleared (an at-fork hook
    is too early for that): register ``_worker_exit`` to run in ``_exit_function``."""
    with guarded("multiprocessing worker start"):
        util.Finalize(None, _worker_exit, exitpriority=-100)  # last: after the worker's own


with guarded("multiprocessing after-fork hook"):
    util.register_after_fork(STATE, _worker_started)
