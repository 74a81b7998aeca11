"""What ``enable()``, ``disable()`` and the end of the process do, in order: configure the event
log, install the patch table once, open the log and write its header, hook crashes; and the
reverse. Callers hold ``STATE.lock``.

Torch-free at import: the torch side (the patch table, the per-layer summary) is imported by
``_torch_side()`` only once fusionguard is being enabled, or is enabled.
"""

from __future__ import annotations

import atexit
import logging
from typing import Any, Optional

from fusionguard.activate import switched_off
from fusionguard.core.config import UNSET, Config, Runtime, check_log_path, check_options, merged, resolve_log_path
from fusionguard.core.state import STATE, emit, guarded, on_worker_exit, write_stderr
from fusionguard.eventlog import crash, diagnosis
from fusionguard.eventlog.header import header_fields
from fusionguard.eventlog.log import to_torch_trace
from fusionguard.eventlog.sampler import Sampler


def _torch_side() -> Any:
    """``fusionguard.patch_sites`` (imports torch): loaded by the first ``enable()``."""
    from fusionguard import patch_sites  # lazy: it imports torch, and `import fusionguard` must not

    return patch_sites


def _announce(path: Optional[str]) -> None:
    if path is None or STATE.announced_path == path:
        return
    STATE.announced_path = path
    write_stderr(
        f"fusionguard: logging FlexAttention verdicts to {path} "
        "(FUSIONGUARD_LOG or enable(log_path=...) to change, log_path=False for none)\n",
        logging.INFO,
    )


def _on_sink_error(exc: BaseException) -> None:
    write_stderr(
        f"fusionguard: cannot write the log {STATE.config.log_path} ({exc}); events go on in memory "
        "(fusionguard.events()) and each new event tries the file again\n"
    )


def _on_sink_resume(unwritten: int) -> None:
    write_stderr(
        f"fusionguard: writing the log {STATE.config.log_path} again; {unwritten} event(s) so far could not be written to it\n",
        logging.INFO,
    )


def _install_once() -> Any:
    """The first enable(): every patch, and the graphs compiled before it; say what is missing."""
    torch_side = _torch_side()
    STATE.not_patched = {}
    unavailable = torch_side.install_patches()
    live = torch_side.live_graphs()
    for name, why in STATE.not_patched.items():
        if name in unavailable:
            write_stderr(f"fusionguard: {why}\n", logging.INFO)  # (a feature this release lacks)
        else:
            write_stderr(f"fusionguard: could not patch {name} ({why}); that part is not guarded\n")
    return live


def _open_log(config: Config, live: Any) -> None:
    """A new file (or the first enable()): close the old one, open this one, write its header."""
    STATE.log.close()
    crash.release_native()
    STATE.crash_fields = {}
    if config.log_path is not None:
        try:
            STATE.log.open(
                config.log_path,
                fsync=config.fsync,
                max_bytes=config.log_max_bytes,
                backups=config.log_backups,
                mode=config.log_mode,
                shared=STATE.log_dir is None,
            )  # (a log directory: a file per process)
            STATE.durable_keys.clear()
            _announce(config.log_path)
            STATE.crash_fields = crash.capture_native(config.log_path, config.log_mode, STATE.patches)
        except OSError as exc:
            write_stderr(
                f"fusionguard: cannot open log file {config.log_path!r} ({exc}); events are kept in memory only (fusionguard.events())\n"
            )
            config.log_path = None
    with guarded("header"):  # the guard must be on even if the header cannot be built
        patched = [n for n in STATE.patches.names() if not n.startswith("graph ")]  # (not each graph's wrapper)
        header = header_fields(patched, dict(STATE.not_patched), config.public())
        if live is not None:  # graphs compiled before enable() that fusionguard cannot see, and the fix
            header.update(_torch_side().unseen_fields(live[0]))
        STATE.log.emit("info", "header", **header, **STATE.crash_fields)


def _last_flex() -> Optional[dict]:
    return diagnosis.last_flex(STATE.log.memory)


def _counts() -> dict:
    return {"counts": dict(STATE.counts)}


def _write_lock() -> Any:
    return STATE.log.write_lock  # (a forked child's log has a lock of its own)


#: ``enable()`` calls in progress (read by the start-up hook, ``_startup/sitecustomize.py``).
enabling = 0


def enable_as(by: str, /, strict: Any = UNSET, log_path: Any = UNSET, **options: Any) -> None:
    """``fusionguard.enable()`` (its docstring), made for ``by``: ``"program"`` (the program's own
    call), ``"launcher"`` (``FUSIONGUARD=`` / ``fusionguard run``: the start-up hook) or ``"session"``
    (``fusionguard.track()``). Who wins: a session's explicit settings replace the launcher's or an
    earlier session's, never the program's (``session.py`` reads ``STATE.enabled_by`` for that)."""
    # Every argument is checked before anything is installed: a bad one raises, naming it, and
    # leaves the process as it was (also under the kill switch: the call is wrong either way).
    check_options(options)
    named = dict(options) if strict is UNSET else {**options, "strict": strict}
    for key in ("strict", "mode"):  # (None names nothing: the same rule for both, #32)
        if key in named and named[key] is None:
            del named[key]
    Config(**named)  # (checked alone: a bad argument is named, whatever is running)
    if log_path is not UNSET:
        check_log_path(log_path)
    if switched_off():  # FUSIONGUARD=off: the kill switch wins over code
        return
    global enabling
    with STATE.lock:
        enabling += 1  # (its first call imports torch: the start-up hook leaves this call's settings be)
        try:
            config = merged(STATE.config, named) if STATE.enabled else Config(**named)
            if log_path is UNSET and STATE.enabled:  # (not named: the same file stays open)
                config.log_path, log_dir = STATE.config.log_path, STATE.log_dir
            else:
                config.log_path, log_dir = resolve_log_path(None if log_path is UNSET else log_path)
            try:
                start(config, log_dir)
            except BaseException as exc:  # never half-enabled: patches in while is_enabled() is False
                undo_start(exc)
                raise
            STATE.enabled_by = by
        finally:
            enabling -= 1


def start(config: Config, log_dir: Optional[str]) -> None:
    """``enable()`` with a validated ``config`` whose ``log_path`` is resolved."""
    new_log = config.log_path != STATE.config.log_path
    reopen = new_log or STATE.log.sink is None
    if reopen and STATE.enabled and STATE.log.sink is not None:
        with guarded("shutdown event (log_path changed)"):  # the old file's run ends here, not "killed", with its own summary
            _torch_side().final_events("log_path changed", next_log=config.log_path)
    if new_log:
        _torch_side().new_log_stats()
    STATE.log_dir = log_dir
    STATE.config = config
    # one assignment: a call in flight sees all old or all new (a first enable(): still off while installing)
    STATE.runtime.now = Runtime.of(config, enabled=STATE.enabled)
    sampler = Sampler(
        first=config.fused_first,
        every=config.fused_every,
        keep_all=config.keep_all,
        dense_first=config.dense_first,
        dense_every=config.dense_every,
    )
    STATE.log.configure(config.max_events, sampler, STATE.flusher.poke, _on_sink_error, _on_sink_resume, to_torch_trace)
    STATE.flusher.configure(config.flush_interval)
    first = not STATE.enabled
    live = None
    if first:
        live = _install_once()
    if reopen or first:
        _open_log(config, live)
    elif STATE.log.set_sink_options(config.fsync, config.log_max_bytes, config.log_backups):
        STATE.durable_keys.clear()  # sites seen with fsync off were never made durable
    STATE.runtime.now = Runtime.of(config, enabled=True)
    if live is not None and live[0]:  # (after the header: their records are events of this log)
        _torch_side().adopt_live_graphs(*live)
    with guarded("crash hooks"):
        crash.install(emit, last_flex_event=_last_flex, summary=_counts, registry=STATE.patches, write_lock=_write_lock)
    if not STATE.atexit_registered:  # atexit has no undo we may use (unregister drops every
        atexit.register(at_exit)  # registration of the function): once, a no-op while disabled
        STATE.atexit_registered = True


def undo_start(exc: BaseException) -> None:
    """``start()`` failed part-way: take out everything it may have put in (patches, hooks, the
    log), so the process is never half-enabled (patches in while ``is_enabled()`` is False); the
    next ``enable()`` starts as a first one. Each step on its own: one failing stops none."""
    STATE.runtime.now = Runtime()  # off, the defaults
    steps = (STATE.patches.remove_all, STATE.flusher.stop, STATE.log.close)
    for step in steps:
        with guarded("undoing a failed enable()"):
            step()
    STATE.config = Config()
    if isinstance(exc, Exception):
        exc.add_note("fusionguard.enable() failed and undid itself: nothing of fusionguard is installed (is_enabled() is False)")


def stop() -> None:
    """``disable()``: every patch, hook and handler undone (newest first), the log ended and closed."""
    if not STATE.enabled and not STATE.patches.entries():
        crash.tidy()  # a SIGTERM handler left by a disable() from another thread
        return
    STATE.runtime.now = Runtime()  # off, and nothing of this enable()'s options stays behind
    STATE.enabled_by = None
    STATE.patches.remove_all()  # every patch, hook, handler, callback, session and the crash file, newest first
    STATE.log.mirror = None
    STATE.flusher.stop()
    with guarded("shutdown event"):
        _torch_side().final_events("disable")
    STATE.log.close()


def at_exit() -> None:
    """The process ends: the last counters, the summary and the shutdown event."""
    try:
        with STATE.lock:
            if STATE.enabled and STATE.log.open_pending is None:  # (set: a forked child that never logged)
                STATE.flusher.stop()
                _torch_side().final_events("exit")
                STATE.log.close()
                crash.release_native()
    except Exception:
        pass


on_worker_exit(at_exit)  # (a multiprocessing worker ends with os._exit: core.state._worker_exit runs this)
