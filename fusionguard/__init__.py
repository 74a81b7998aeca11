"""fusionguard: see, name and stop FlexAttention's silent dense fallback.

    import fusionguard
    fusionguard.enable(strict=True)

Every FlexAttention call that really runs the dense ``sdpa_dense`` / ``sdpa_dense_backward``
kernels is logged (JSON lines) with its phase, shapes, score-matrix size, call site and cause;
strict mode raises ``DenseFallbackError`` before the dense kernel allocates. Inductor-compiled
calls are recorded at compile time (and on cache hits) as fused.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import threading
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple, Union

from ._state import ALLOW_DENSE, OPTIONS, STATE, Config, internal_error, write_stderr
from ._version import __version__
from .errors import DenseFallbackError, DenseFallbackWarning

if TYPE_CHECKING:  # imported lazily: `import fusionguard` must not import torch (pytest plugin)
    from ._summary import Summary, export, summary
    from .watching import peak_memory_allocated, watch

_LAZY = {
    "Summary": "._summary",
    "export": "._summary",
    "summary": "._summary",
    "peak_memory_allocated": ".watching",
    "watch": ".watching",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fusionguard' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value

__all__ = [
    "DenseFallbackError",
    "DenseFallbackWarning",
    "Summary",
    "__version__",
    "allow_dense",
    "disable",
    "enable",
    "events",
    "export",
    "is_enabled",
    "peak_memory_allocated",
    "summary",
    "watch",
]

DEFAULT_LOG_NAME = "fusionguard.jsonl"


def _default_log_file() -> str:
    from .log import rank_info

    info = rank_info()
    if info["world_size"] > 1:
        return f"fusionguard.rank{info['rank']}.jsonl"
    return DEFAULT_LOG_NAME


def _resolve_log_path(log_path: Union[str, os.PathLike, None, bool]) -> Tuple[Optional[str], Optional[str]]:
    """(the log file, the directory when ``log_path`` names one: a file per process in it)."""
    if log_path is False:
        return None, None
    if log_path is None or log_path is True:
        log_path = os.environ.get("FUSIONGUARD_LOG") or _default_log_file()
    path = os.path.abspath(os.path.expanduser(os.fspath(log_path)))
    if os.path.isdir(path) or str(log_path).endswith(os.sep):
        # A directory: each rank and process writes its own file in it.
        from ._state import process_log_name

        return os.path.join(path, process_log_name()), path
    return path, None


def _install_patches() -> List[str]:
    """Install every patch; returns the names of features this torch release lacks (recorded in
    ``not_patched`` too, with the sentence that says what is unavailable)."""
    from . import guard, inductor, torch_internals as ti
    from .dynamo_signals import SIGNALS

    reg, missing = STATE.patches, STATE.not_patched
    unavailable: List[str] = []

    def attempt(name: str, fn: Any) -> None:
        try:
            fn()
        except ti.Unavailable as exc:  # the release lacks it: nothing to guard there
            missing[name] = str(exc)
            unavailable.append(name)
        except Exception as exc:  # version drift: say what could not be patched
            missing[name] = f"{type(exc).__name__}: {exc}"

    def dense(op_name: str, phase: str) -> None:
        op = ti.hop(op_name)
        ti.dense_kernel(op)
        reg.apply(
            f"{op_name}.CompositeExplicitAutograd",
            op.py_kernels,
            ti.dense_key(),
            lambda orig: guard.make_dense_wrapper(phase, orig),
            after=lambda: ti.clear_dispatch_cache(op),
        )

    def autograd_op() -> None:
        cls = ti.autograd_op()
        reg.apply("FlexAttentionAutogradOp.forward", vars(cls), "forward", guard.make_autograd_forward, owner=cls)
        reg.apply("FlexAttentionAutogradOp.backward", vars(cls), "backward", guard.make_autograd_backward, owner=cls)

    def lowerings() -> None:
        import torch

        table = ti.lowerings()
        for op, phase in ((torch.ops.higher_order.flex_attention, "forward"), (torch.ops.higher_order.flex_attention_backward, "backward")):
            if op not in table:
                raise LookupError(f"no Inductor lowering registered for {op}")
            reg.apply(f"inductor.lowerings[{op}]", table, op, functools.partial(inductor.make_lowering_wrapper, phase))
        mod = ti.flex_lowering_module()
        for fn_name, template in ti.TEMPLATE_SELECTORS.items():
            if callable(mod.__dict__.get(fn_name)):
                reg.apply(
                    f"inductor.{mod.__name__}.{fn_name}",
                    mod.__dict__,
                    fn_name,
                    functools.partial(inductor.make_selector_wrapper, template),
                )

    def post_compile() -> None:
        cls = ti.compiled_fx_graph()
        reg.apply("inductor.CompiledFxGraph.post_compile", vars(cls), "post_compile", inductor.make_post_compile_wrapper, owner=cls)

    def compile_wrappers() -> None:
        from . import watching

        cls = ti.optimized_module()
        reg.apply("OptimizedModule.__init__", vars(cls), "__init__", watching.make_wrapper_init, owner=cls)

    def rescue() -> None:
        from . import rescue as rescue_mod

        home = ti.setup_compilation_env_home()
        reg.apply("flex_attention.setup_compilation_env", home, "setup_compilation_env", rescue_mod.make_setup_env_wrapper)

    def signals() -> None:
        SIGNALS.emit = lambda level, event, **fields: STATE.log.emit(level, event, **fields)
        SIGNALS.on_error = internal_error
        SIGNALS.install(reg)

    attempt("flex_attention (dense forward)", lambda: dense("flex_attention", "forward"))
    attempt("flex_attention_backward (dense backward)", lambda: dense("flex_attention_backward", "backward"))
    attempt("FlexAttentionAutogradOp", autograd_op)
    attempt("inductor lowerings", lowerings)
    attempt("inductor CompiledFxGraph.post_compile", post_compile)
    attempt("dynamo signals", signals)
    attempt("torch.compile module wrapper (watch)", compile_wrappers)
    attempt("rescue (setup_compilation_env)", rescue)
    return unavailable


def _announce(path: Optional[str]) -> None:
    if path is None or STATE.announced_path == path:
        return
    STATE.announced_path = path
    write_stderr(
        f"fusionguard: logging FlexAttention verdicts to {path} "
        "(FUSIONGUARD_LOG or enable(log_path=...) to change, log_path=False for none)\n"
    )


def _on_sink_error(exc: BaseException) -> None:
    write_stderr(
        f"fusionguard: cannot write the log {STATE.config.log_path} ({exc}); events go on in memory "
        "(fusionguard.events()) and each new event tries the file again\n"
    )


def _on_sink_resume(unwritten: int) -> None:
    write_stderr(f"fusionguard: writing the log {STATE.config.log_path} again; {unwritten} event(s) so far could not be written to it\n")


def _live_graphs() -> Any:
    """Compiled graphs holding FlexAttention made before this enable() (see inductor)."""
    try:
        from .inductor import live_flex_graphs

        return live_flex_graphs()
    except Exception as exc:
        internal_error("search for graphs compiled before enable()", exc)
        return [], 0.0


def enable(
    strict: bool = False,
    log_path: Union[str, os.PathLike, None, bool] = None,
    **options: Any,
) -> None:
    """Install the guard (idempotent: a second call reconfigures, never double-wraps).

    strict:   raise ``DenseFallbackError`` before a dense FlexAttention kernel allocates;
              otherwise warn (``DenseFallbackWarning``) and log.
    log_path: JSON-lines file (or a directory: one file per rank and process). Default: env
              ``FUSIONGUARD_LOG``, else ``./fusionguard.jsonl`` (``fusionguard.rank{N}.jsonl`` under
              torchrun). ``False``: no file, events only in memory (``fusionguard.events()``).
    options:  ``fsync`` (default True: the first dense event of each call site, layer and phase
              reaches the disk before the kernel runs, repeats are written but not fsync-ed;
              ``"always"``: every one; False: none),
              ``fused_first`` / ``fused_every`` / ``keep_all`` (fused per-call events: the first 10
              per layer and phase, then a counter every 1000 calls; or all), ``dense_first`` /
              ``dense_every`` (the same for repeats of one dense call: the first 10 per call
              site, layer, phase, cause and action are logged in full, then a ``dense_calls``
              counter every 1000; a blocked call is always logged), ``log_max_bytes`` /
              ``log_backups`` (size-based rotation, off by default),
              ``max_events`` (default 10000: events kept in memory), ``rescue`` (default False:
              run eager FlexAttention calls through a fused Inductor compile instead of the dense
              kernels; logged as ``path: "rescued"``; strict mode then raises only for calls that
              cannot be rescued), ``flush_interval`` (default 0.5 s: counted calls reach the file
              within it, so a killed process loses at most that much of its counts; 0: only
              every N calls and at exit), ``log_mode`` (default 0o600: new log / crash files).
    ``FUSIONGUARD=off`` in the environment makes this a no-op (kill switch; docs/guarantees.md).
    """
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise TypeError(f"fusionguard.enable() got unknown option(s) {sorted(unknown)}; known: {list(OPTIONS)}")
    from . import activate

    if activate.switched_off():  # FUSIONGUARD=off: the kill switch wins over code
        return
    with STATE.lock:
        config = Config(strict=strict, **options)
        config.log_path, log_dir = _resolve_log_path(log_path)
        new_log = config.log_path != STATE.config.log_path
        reopen = new_log or STATE.log.sink is None
        if reopen and STATE.enabled and STATE.log.sink is not None:
            try:  # the old file's run ends here, not "killed", with its own summary
                _final_events("log_path changed", next_log=config.log_path)
            except Exception as exc:
                internal_error("shutdown event (log_path changed)", exc)
        if new_log:  # summary rows are the log's: a new file counts its own calls only
            STATE.stats.new_log()
        STATE.log_dir = log_dir
        STATE.config = config
        STATE.log.set_max_events(config.max_events)
        from .log import FusedSampler

        STATE.log.flush_sampler()
        STATE.log.sampler = FusedSampler(
            first=config.fused_first,
            every=config.fused_every,
            keep_all=config.keep_all,
            dense_first=config.dense_first,
            dense_every=config.dense_every,
        )
        STATE.log.sampler.on_pending = STATE.flusher.poke
        STATE.flusher.configure(config.flush_interval)
        STATE.log.on_sink_error = _on_sink_error
        STATE.log.on_sink_resume = _on_sink_resume
        from .log import to_torch_trace

        STATE.log.mirror = to_torch_trace
        first = not STATE.enabled
        live: Any = ([], 0.0)
        if first:
            STATE.not_patched = {}
            unavailable = _install_patches()
            live = _live_graphs()
            for name, why in STATE.not_patched.items():
                if name in unavailable:
                    write_stderr(f"fusionguard: {why}\n")
                else:
                    write_stderr(f"fusionguard: could not patch {name} ({why}); that part is not guarded\n")
        if reopen or first:
            from . import crash

            STATE.log.close()
            crash.release_native()
            STATE.crash_fields = {}
            if config.log_path is not None:
                try:
                    STATE.log.open(config.log_path, fsync=config.fsync, max_bytes=config.log_max_bytes, backups=config.log_backups, mode=config.log_mode)
                    STATE.durable_keys.clear()
                    _announce(config.log_path)
                    STATE.crash_fields = crash.capture_native(config.log_path, config.log_mode)
                except OSError as exc:
                    write_stderr(
                        f"fusionguard: cannot open log file {config.log_path!r} ({exc}); "
                        "events are kept in memory only (fusionguard.events())\n"
                    )
                    config.log_path = None
            try:
                from .log import header_fields

                patched = [n for n in STATE.patches.names() if not n.startswith("graph ")]  # (not each graph's wrapper)
                header = header_fields(patched, dict(STATE.not_patched), config.public())
                if first:  # graphs compiled before enable() that fusionguard cannot see, and the fix
                    from .inductor import UNSEEN_FIX, unseen_graphs

                    unseen = unseen_graphs(live[0])
                    header.update(unseen_graphs=unseen, unseen_graphs_fix=UNSEEN_FIX if unseen else None)
                STATE.log.emit("info", "header", **header, **STATE.crash_fields)
            except Exception as exc:  # the guard must be on even if the header cannot be built
                internal_error("header", exc)
        elif STATE.log.sink is not None:
            if STATE.log.sink.fsync != config.fsync:
                STATE.durable_keys.clear()  # sites seen with fsync off were never made durable
            STATE.log.sink.fsync = config.fsync
            STATE.log.sink.max_bytes = config.log_max_bytes or None
            STATE.log.sink.backups = config.log_backups
        STATE.enabled = True
        if first and live[0]:  # (after the header: their records are events of this log)
            try:
                from .inductor import adopt_live_graphs

                adopt_live_graphs(*live)
            except Exception as exc:
                internal_error("graphs compiled before enable()", exc)
        try:
            from . import crash

            crash.install(
                lambda level, event, **f: STATE.log.emit(level, event, **f),
                last_flex_event=lambda: crash.last_flex(STATE.log.memory),
                summary=lambda: {"counts": dict(STATE.counts)},
                registry=STATE.patches,
            )
        except Exception as exc:
            internal_error("crash hooks", exc)
        if not STATE.atexit_registered:  # atexit has no undo we may use (unregister drops every
            atexit.register(_at_exit)  # registration of the function): once, a no-op while disabled
            STATE.atexit_registered = True


def _final_events(reason: str, **extra: Any) -> None:
    """The per-layer summary and the shutdown event that end a log (disable, exit, a new log_path)."""
    STATE.log.emit("info", "summary", counts=dict(STATE.counts), rows=STATE.stats.summary())
    STATE.log.emit("info", "shutdown", reason=reason, **extra, counts=dict(STATE.counts))


def disable() -> None:
    """Remove every patch (the original objects go back), write a shutdown event, close the log."""
    from . import crash
    from .dynamo_signals import SIGNALS
    with STATE.lock:
        if not STATE.enabled and not STATE.patches.entries():
            crash.tidy()  # a SIGTERM handler left by a disable() from another thread
            return
        STATE.enabled = False
        STATE.patches.remove_all()  # every patch, hook, handler and callback, newest first
        STATE.log.mirror = None
        SIGNALS.remove()  # (its handler and callback are gone already: forgets what Dynamo said)
        crash.uninstall()
        STATE.flusher.stop()
        try:
            _final_events("disable")
        except Exception as exc:
            internal_error("shutdown event", exc)
        STATE.log.close()
        crash.release_native()


def _at_exit() -> None:
    try:
        with STATE.lock:
            if STATE.enabled and STATE.log.open_pending is None:  # (set: a forked child that never logged)
                STATE.flusher.stop()
                _final_events("exit")
                STATE.log.close()
                from . import crash

                crash.release_native()
    except Exception:
        pass


def is_enabled() -> bool:
    """True between ``enable()`` and ``disable()``."""
    return STATE.enabled


@contextlib.contextmanager
def allow_dense() -> Iterator[None]:
    """Inside this block strict mode does not raise; dense events say ``allowed: true``.

    A backward whose forward ran inside the block is allowed too, wherever it runs.
    """
    token = ALLOW_DENSE.set(True)
    tid = threading.get_ident()
    with STATE.lock:
        STATE.allow_threads[tid] = STATE.allow_threads.get(tid, 0) + 1
    try:
        yield
    finally:
        ALLOW_DENSE.reset(token)
        with STATE.lock:
            n = STATE.allow_threads.get(tid, 1) - 1
            if n <= 0:
                STATE.allow_threads.pop(tid, None)
            else:
                STATE.allow_threads[tid] = n


def events(kind: Optional[str] = None) -> List[Dict[str, Any]]:
    """The most recent events (bounded, newest last); ``kind`` filters on the ``event`` field."""
    items = list(STATE.log.memory)
    if kind is not None:
        items = [e for e in items if e.get("event") == kind]
    return [dict(e) for e in items]
