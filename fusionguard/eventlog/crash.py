"""Crash records: what was FlexAttention doing when the process died?

``install(emit, last_flex_event=..., summary=..., registry=...)`` adds, each with its undo in
``registry`` (fusionguard's one undo registry: ``disable()`` removes them; ``uninstall()`` without
one):

- ``sys.excepthook`` and ``threading.excepthook``: an uncaught exception writes a ``crash``
  event (exception type and message, the thread, the last frames, the last FlexAttention event,
  CUDA allocator figures when CUDA is initialised, a one-line ``diagnosis``), then calls the hook
  that was there before, unchanged;
- a SIGTERM handler (main thread only; what schedulers and torchrun send): writes a ``shutdown``
  event with ``reason: "sigterm"`` at level ``warning`` (so it is fsync-ed), then hands the
  signal to the previous handler: a Python handler is called, or ``SIG_DFL`` is restored and the
  signal re-raised (the process dies of SIGTERM as it would have). If the signal interrupted the
  main thread while it held the log's lock, the write is finished by a helper thread and the
  signal delivered again (see ``_on_sigterm``): never a deadlock. The counts are read in the
  same hold of the log's lock as the event is written (``write_lock``), and from the signal
  until it is handed over the guard counts and logs no call (``sigterm_pending()``): the
  ``shutdown`` event's counts are those of the events before it, and none follows it. Nothing
  is installed when SIGTERM was ignored (``SIG_IGN``) or handled outside Python: the process
  would not stop, or we could not hand it on.

This module knows nothing of fusionguard's global state: it logs through ``emit(level, event,
**fields)`` and reads the last FlexAttention event through ``last_flex_event()``; it imports
torch only if the program already did. ``uninstall()`` puts back the exact previous hooks, when
ours are still the ones installed; if somebody replaced ours meanwhile, theirs stay and ours turn
into plain pass-throughs. ``record(exc)`` writes a crash event for an exception the program
caught itself.

Native crashes (a segfault or abort inside PyTorch, where no Python hook runs):
``capture_native(log_path)`` points CPython's ``faulthandler`` at a file beside the log (the
fatal signal and every thread's Python stack), unless the host already enabled ``faulthandler``
(pytest does): then it is left alone and the header says ``crash_capture: "host-owned"``.
``release_native()`` disables it again (and removes the file if nothing was written); so does
its registry entry, ``faulthandler: crash file``. ``report/crashfile.py`` reads such a file.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import traceback
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Dict, List, Optional, Tuple

from fusionguard.eventlog.diagnosis import MAX_MESSAGE, compact_flex, diagnose, exception_name
from fusionguard.eventlog.sink import open_regular

if TYPE_CHECKING:  # (only for types: this module is also loaded standalone, without the package)
    from fusionguard.core.registry import PatchRegistry

Emit = Callable[..., Any]

_MAX_TRACEBACK = 4000


class CrashHooks:
    """This module's process-wide bookkeeping, one object (fusionguard's ``State.crash``): the
    hooks it replaced, what they call, the faulthandler file it owns. Never reset while hooks
    are installed: only their undo (the registry's entries, or ``uninstall()``) puts the
    previous ones back."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.active = False
        self.emit: Optional[Emit] = None
        self.last_flex: Optional[Callable[[], Optional[dict]]] = None
        self.summary: Optional[Callable[[], Dict[str, Any]]] = None
        self.write_lock: Optional[Callable[[], ContextManager[Any]]] = None
        self.prev_sys: Any = None
        self.prev_threading: Any = None
        self.prev_sigterm: Any = None
        self.sigterm_installed = False
        self.native: Optional[Tuple[int, str]] = None  # (fd, path) of the faulthandler file we own
        self.native_registry: Optional[PatchRegistry] = None  # where that file's undo is recorded
        self.registry: Optional[PatchRegistry] = None  # where the hooks' undo is recorded (the package's)
        # SIGTERM handling: "idle"; "pending" (the shutdown event is being written); "done"
        # (written, or given up on: hand the signal over on the next delivery)
        self.sigterm_state = "idle"

    def after_fork_in_child(self) -> None:
        """The lock is free in the child (its holder does not exist here); no SIGTERM in flight."""
        fresh = getattr(self.lock, "_at_fork_reinit", None)
        if fresh is not None:
            fresh()
        else:
            self.lock = threading.RLock()
        self.sigterm_state = "idle"


CRASH = CrashHooks()
_in_hook = threading.local()  # per thread by design: a hook that fails while reporting


# -- public -------------------------------------------------------------------------------------


def install(
    emit: Emit,
    last_flex_event: Optional[Callable[[], Optional[dict]]] = None,
    summary: Optional[Callable[[], Dict[str, Any]]] = None,
    sigterm: bool = True,
    registry: Optional[PatchRegistry] = None,
    write_lock: Optional[Callable[[], ContextManager[Any]]] = None,
) -> None:
    """Install the hooks (a second call only updates the callables: never chains twice).

    emit:            ``emit(level, event, **fields)`` writes one event.
    last_flex_event: returns the most recent FlexAttention event (a dict) or None.
    summary:         returns extra fields for the SIGTERM ``shutdown`` event (e.g. ``counts``).
    sigterm:         also handle SIGTERM (only possible from the main thread; skipped otherwise).
    registry:        where each hook's undo is recorded (``disable()`` removes it); None: only ``uninstall()``.
    write_lock:      returns the lock ``emit`` writes under (re-entrant): ``summary()`` is read and
                     the SIGTERM ``shutdown`` written in one hold of it, so its counts are those of
                     the events before it (docs/guarantees.md).
    """
    with CRASH.lock:
        reg = CRASH.registry = registry
        CRASH.emit, CRASH.last_flex, CRASH.summary, CRASH.write_lock = emit, last_flex_event, summary, write_lock
        _record(reg, "crash: recording", _stop_recording, lambda: not CRASH.active)  # (first: undone after the hooks)
        if sys.excepthook is not _sys_hook:
            _forget(reg, "sys.excepthook")
            CRASH.prev_sys = prev_sys = sys.excepthook
            sys.excepthook = _sys_hook
            _record(reg, "sys.excepthook", _restore_sys, lambda: sys.excepthook is prev_sys)
        if threading.excepthook is not _thread_hook:
            _forget(reg, "threading.excepthook")
            CRASH.prev_threading = prev_thread = threading.excepthook
            threading.excepthook = _thread_hook
            _record(reg, "threading.excepthook", _restore_threading, lambda: threading.excepthook is prev_thread)
        if sigterm:
            _install_sigterm(reg)
        CRASH.active = True


def uninstall() -> None:
    """Stop recording; put back the previous hooks where ours are still installed. (With a
    registry, its entries do all of it: ``disable()`` removes them, newest first.)"""
    with CRASH.lock:
        if CRASH.registry is not None:
            for name in ("signal.SIGTERM", "threading.excepthook", "sys.excepthook", "crash: recording"):
                CRASH.registry.remove(name)
        _restore_sys()  # (no-ops when the registry's entries did it)
        _restore_threading()
        _uninstall_sigterm()
        _stop_recording()


def _stop_recording() -> None:
    """Our hooks, wherever they still are (somebody may have chained to them), write nothing."""
    with CRASH.lock:
        CRASH.active = False
        CRASH.emit = CRASH.last_flex = CRASH.summary = CRASH.write_lock = None


def _forget(reg: Optional[PatchRegistry], name: str) -> None:
    """Drop an entry whose hook somebody replaced (its undo is a no-op now), before ours goes
    back in: then the entry recorded next is the one that undoes it."""
    if reg is not None:
        reg.remove(name)


def _record(reg: Optional[PatchRegistry], name: str, undo: Callable[[], None], restored: Callable[[], bool]) -> None:
    if reg is not None:
        reg.add_hook(name, undo, restored)


def _restore_sys() -> None:
    with CRASH.lock:
        if sys.excepthook is _sys_hook and CRASH.prev_sys is not None:
            sys.excepthook = CRASH.prev_sys
            CRASH.prev_sys = None


def _restore_threading() -> None:
    with CRASH.lock:
        if threading.excepthook is _thread_hook and CRASH.prev_threading is not None:
            threading.excepthook = CRASH.prev_threading
            CRASH.prev_threading = None


def sigterm_pending() -> bool:
    """SIGTERM arrived and its ``shutdown`` event is being written, or is written and the signal
    not yet handed over: the process is ending, and no event may follow that one (the guard
    stops counting and logging calls; docs/guarantees.md)."""
    return CRASH.sigterm_state != "idle"


def tidy() -> None:
    """After a ``disable()`` from another thread left our SIGTERM handler in place (as a
    pass-through: signals cannot be touched there), remove it now if this is the main thread."""
    with CRASH.lock:
        if not CRASH.active:
            _uninstall_sigterm()


# -- native crashes: faulthandler ------------------------------------------------------------------


def crash_file_for(log_path: str) -> str:
    """``run.jsonl`` -> ``run.pid{P}.crash`` (one per process: faulthandler's text has no pid)."""
    base = log_path[: -len(".jsonl")] if log_path.endswith(".jsonl") else log_path
    tag = f".pid{os.getpid()}"
    return (base if base.endswith(tag) else base + tag) + ".crash"


def capture_native(log_path: str, mode: int = 0o600, registry: Optional[PatchRegistry] = None) -> Dict[str, Any]:
    """Send fatal-signal reports to a file beside ``log_path``; the header fields that say so.
    ``registry``: where its undo is recorded (``release_native``; default: the one ``install()``
    was given, e.g. in a forked child)."""

    with CRASH.lock:
        path = crash_file_for(log_path)
        if CRASH.native is not None:
            if CRASH.native[1] == path or CRASH.native[1].startswith(path[: -len(".crash")] + "-"):
                return {"crash_capture": "faulthandler", "crash_file": CRASH.native[1]}
            release_native()
        if faulthandler.is_enabled():
            return {"crash_capture": "host-owned", "crash_file": None}
        fd = -1
        try:
            for n in range(1, 100):  # a crash file of an earlier process with our pid (containers
                fd = open_regular(path, mode)  # reuse pids) is kept: take the next free name
                if os.fstat(fd).st_size == 0:
                    break
                os.close(fd)
                fd = -1
                path = f"{crash_file_for(log_path)[: -len('.crash')]}-{n}.crash"
            else:
                raise OSError("no free crash file name")
            faulthandler.enable(file=fd, all_threads=True)
        except Exception as exc:
            if fd >= 0:
                os.close(fd)
            return {"crash_capture": "off", "crash_capture_error": f"{type(exc).__name__}: {exc}", "crash_file": None}
        CRASH.native = owned = (fd, path)
        reg = CRASH.native_registry = registry if registry is not None else CRASH.registry
        if reg is not None:
            reg.remove("faulthandler: crash file")  # (a stale entry: its restored() is about the file it was for)
            reg.add_hook("faulthandler: crash file", _release, lambda: CRASH.native != owned and not faulthandler.is_enabled())
        return {"crash_capture": "faulthandler", "crash_file": path}


def release_native(after_fork: bool = False) -> None:
    """Give ``faulthandler`` back as it was (off) if we turned it on; remove an empty crash file;
    drop its registry entry. ``after_fork``: in a forked child, where the file is the parent's
    (closed, never removed)."""
    with CRASH.lock:
        _release(after_fork)
        reg, CRASH.native_registry = CRASH.native_registry, None
        if reg is not None:
            reg.remove("faulthandler: crash file")  # (its undo, _release, has nothing left to do)


def _release(after_fork: bool = False) -> None:
    """The ``faulthandler`` entry's undo (``disable()``): ``release_native`` but the entry."""
    with CRASH.lock:
        if CRASH.native is None:
            return
        fd, path = CRASH.native
        CRASH.native = None
        try:
            faulthandler.disable()
        except Exception:
            pass
        try:
            empty = os.fstat(fd).st_size == 0
            os.close(fd)
            if empty and not after_fork:
                os.unlink(path)
        except OSError:
            pass


def record(exc: BaseException, where: str = "record", thread: Optional[str] = None) -> Optional[dict]:
    """Write a ``crash`` event for ``exc`` now (e.g. an exception the program caught). Never raises."""
    try:
        return _write_crash(type(exc), exc, exc.__traceback__, where, thread)
    except Exception:
        return None


# -- what goes into the crash event ----------------------------------------------------------------


def _frames(tb: Any) -> List[traceback.FrameSummary]:
    try:
        return list(traceback.extract_tb(tb)) if tb is not None else []
    except Exception:
        return []


def cuda_memory() -> Optional[Dict[str, Any]]:
    """Allocator figures of the current device, only when the program initialised CUDA."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
        device = torch.cuda.current_device()
        return {
            "device": device,
            "allocated": int(torch.cuda.memory_allocated(device)),
            "reserved": int(torch.cuda.memory_reserved(device)),
            "peak": int(torch.cuda.max_memory_allocated(device)),
        }
    except Exception:
        return None


def _write_crash(exc_type: type, exc: Optional[BaseException], tb: Any, where: str, thread: Optional[str]) -> Optional[dict]:
    emit = CRASH.emit
    if emit is None or not CRASH.active:
        return None
    if getattr(_in_hook, "busy", False):  # an exception inside our own recording: never loop
        return None
    _in_hook.busy = True
    try:
        try:
            message = str(exc) if exc is not None else ""
        except Exception:
            message = "<unprintable exception>"
        flex = None
        if CRASH.last_flex is not None:
            try:
                flex = CRASH.last_flex()
            except Exception:
                flex = None
        frames = _frames(tb)
        fields: Dict[str, Any] = {
            "exc_type": exception_name(exc_type),
            "message": message[:MAX_MESSAGE],
            "where": where,
            "last_flex": compact_flex(flex),
            "diagnosis": diagnose(exc_type, message, flex, frames),
            "frames": [f"{f.filename}:{f.lineno} in {f.name}" for f in frames[-8:]],
        }
        try:
            text = "".join(traceback.format_exception(exc_type, exc, tb))
            fields["traceback"] = text[-_MAX_TRACEBACK:]
        except Exception:
            pass
        memory = cuda_memory()
        if memory is not None:
            fields["cuda"] = memory
        if thread is not None:
            fields["thread"] = thread
        return emit("error", "crash", **fields)
    finally:
        _in_hook.busy = False


# -- hooks -----------------------------------------------------------------------------------------


def _sys_hook(exc_type: type, exc: BaseException, tb: Any) -> None:
    try:
        _write_crash(exc_type, exc, tb, "sys.excepthook", None)
    except Exception:
        pass
    prev = CRASH.prev_sys if CRASH.prev_sys is not None else sys.__excepthook__
    prev(exc_type, exc, tb)


def _thread_hook(args: Any) -> None:
    try:
        thread = getattr(args, "thread", None)
        _write_crash(args.exc_type, args.exc_value, args.exc_traceback, "threading.excepthook", getattr(thread, "name", None))
    except Exception:
        pass
    prev = CRASH.prev_threading if CRASH.prev_threading is not None else threading.__excepthook__
    prev(args)


def _install_sigterm(reg: Optional[PatchRegistry]) -> None:
    if CRASH.sigterm_installed or not hasattr(signal, "SIGTERM"):
        if CRASH.sigterm_installed and reg is not None and "signal.SIGTERM" not in {e.name for e in reg.entries()}:
            _record_sigterm(reg)  # a handler left by a disable() from another thread: undo it next time
        return
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        current = signal.getsignal(signal.SIGTERM)
    except (ValueError, OSError):
        return
    if current is _on_sigterm:  # still ours from an earlier install whose restore was impossible
        CRASH.sigterm_installed = True
        _record_sigterm(reg)
        return
    if current is None or current == signal.SIG_IGN:
        return  # set outside Python (cannot hand it on) or ignored (the process would not stop)
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):
        return
    CRASH.prev_sigterm = current
    CRASH.sigterm_installed = True
    _record_sigterm(reg)


def _record_sigterm(reg: Optional[PatchRegistry]) -> None:
    prev = CRASH.prev_sigterm
    if reg is not None:
        reg.add_hook("signal.SIGTERM", _uninstall_sigterm, lambda: signal.getsignal(signal.SIGTERM) is prev)


def _uninstall_sigterm() -> None:
    if not CRASH.sigterm_installed:
        return
    if threading.current_thread() is not threading.main_thread():
        return  # cannot touch signals here; ours stays and passes the signal straight on
    try:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            # prev_sigterm is kept: a trainer's teardown may put ours back after this (Lightning
            # restores the handlers it saved at fit start), and the next install finds it and
            # must restore the same; None (never known) is restored as SIG_DFL, as _hand_over reads it
            prev = CRASH.prev_sigterm
            signal.signal(signal.SIGTERM, signal.SIG_DFL if prev is None else prev)
        CRASH.sigterm_installed = False
    except (ValueError, OSError):
        pass


def _write_sigterm_shutdown() -> None:
    """``summary()`` is read and the event written in one hold of the log's write lock: its
    counts are those of the events before it, whatever the interrupted thread was writing."""
    emit, summary, write_lock = CRASH.emit, CRASH.summary, CRASH.write_lock
    if emit is None or not CRASH.active:
        return
    with write_lock() if write_lock is not None else contextlib.nullcontext():
        fields: Dict[str, Any] = {"reason": "sigterm", "signal": "SIGTERM"}
        if summary is not None:
            try:
                fields.update(summary())
            except Exception:
                pass
        emit("warning", "shutdown", **fields)


_SIGTERM_WAIT_S = 1.0  # the handler waits this long for the write before deferring
_SIGTERM_GIVE_UP_S = 10.0  # a deferred write that has not finished by then is abandoned


def _on_sigterm(signum: int, frame: Any) -> None:
    """Write the ``shutdown`` event, then hand the signal over.

    The handler runs in the main thread between two bytecodes, possibly while that very thread
    holds the log's lock (in the middle of writing or fsync-ing an event). So a helper thread
    writes, and the handler waits a moment. If the write cannot finish (the lock is ours, below
    us on the stack), the handler returns so the main thread can release it; the helper finishes
    the write and delivers SIGTERM again, and this time the handler hands it over at once."""
    if CRASH.sigterm_state == "pending":
        return  # a second SIGTERM while the first is being recorded
    if CRASH.sigterm_state == "done" or not CRASH.active or CRASH.emit is None:
        CRASH.sigterm_state = "idle"
        _hand_over(signum, frame)
        return
    CRASH.sigterm_state = "pending"
    finished = threading.Event()
    deferred = threading.Event()

    def write() -> None:
        try:
            _write_sigterm_shutdown()
        except Exception:
            pass
        finished.set()
        if deferred.is_set() and CRASH.sigterm_state == "pending":
            CRASH.sigterm_state = "done"
            _resend(signum)

    def give_up() -> None:
        if not finished.is_set() and CRASH.sigterm_state == "pending":
            CRASH.sigterm_state = "done"
            _resend(signum)

    threading.Thread(target=write, name="fusionguard-sigterm", daemon=True).start()
    if finished.wait(_SIGTERM_WAIT_S):
        CRASH.sigterm_state = "idle"
        _hand_over(signum, frame)
        return
    deferred.set()
    if finished.is_set() and CRASH.sigterm_state == "pending":  # finished between wait and set
        CRASH.sigterm_state = "idle"
        _hand_over(signum, frame)
        return
    timer = threading.Timer(_SIGTERM_GIVE_UP_S, give_up)
    timer.daemon = True
    timer.start()


def _resend(signum: int) -> None:
    try:
        os.kill(os.getpid(), signum)
    except Exception:
        pass


def _hand_over(signum: int, frame: Any) -> None:
    prev = CRASH.prev_sigterm
    if callable(prev) and prev is not _on_sigterm:
        prev(signum, frame)
        return
    if prev == signal.SIG_IGN:
        return
    # SIG_DFL (or unknown): die of SIGTERM as the process would have without us.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.raise_signal(signal.SIGTERM)
