"""Dynamo's own records, read by causes / dynamo_signals / guard / rescue: its config, cache
entries, counters, compile ids and callbacks, the running graph, torch's log registry."""

from __future__ import annotations

import logging
import os
import types
from typing import Any, Callable, Dict, Optional, Tuple

from fusionguard.torch_internals.lookups import dynamo_frame_graph, module
from fusionguard.torch_internals.names import (
    CACHE_ENTRY_LIST,
    CALL_FUNCTION,
    CALLBACK_TRIGGER,
    COMPILATION_METRICS,
    COMPILE_WRAPPER_FN,
    DISABLE_CONTEXT,
    END_CALLBACKS,
    EVAL_FRAME_FILE,
    FWD_NN_MODULE_STACK,
    FX_CODE_FILE,
    IS_TORCH_HANDLER,
    REGISTER_END_CALLBACK,
    REGISTER_START_CALLBACK,
    SOURCE_CODE,
    STANCE,
    START_CALLBACKS,
    WRAPPER_FN,
    Unavailable,
    torch_version,
)

# --- Dynamo's own records, read by causes / dynamo_signals / guard / rescue ---------------------
# Each lookup answers "nothing" (None, empty, False) where this release keeps it elsewhere: the
# callers then know less about a cause, they never fail.

#: The logger Dynamo reports frames it could not convert (and recompile-limit hits) on.
DYNAMO_CONVERT_FRAME_LOGGER = "torch._dynamo.convert_frame"


def _dynamo_attr(module_name: str, name: str) -> Any:
    try:
        return getattr(module(module_name), name, None)
    except Exception:
        return None


def orig_code_map() -> Any:
    """Dynamo's transformed code -> the user's original code (``torch._dynamo.utils``), or None."""
    return _dynamo_attr("torch._dynamo.utils", "orig_code_map")


def dynamo_seen_code_ids() -> Optional[Any]:
    """Ids of the code objects Dynamo looked at since its last reset (``convert_frame.input_codes``), or None."""
    return getattr(_dynamo_attr("torch._dynamo.convert_frame", "input_codes"), "seen_ids", None)


def dynamo_config() -> Any:
    """``torch._dynamo.config`` (its ``patch()`` context manager and its options), or None."""
    return _dynamo_attr("torch._dynamo", "config")


def dynamo_disabled() -> bool:
    """``TORCHDYNAMO_DISABLE=1`` / ``torch._dynamo.config.disable``."""
    return bool(getattr(dynamo_config(), "disable", False))


def compiler_stance() -> Optional[str]:
    """The stance of ``torch.compiler.set_stance`` (2.6+), or None."""
    return getattr(_dynamo_attr("torch._dynamo.eval_frame", STANCE), "stance", None)


def cache_entries(code: types.CodeType) -> list:
    """Dynamo's cache entries (one per compiled version) for ``code``; [] where unavailable."""
    get = _dynamo_attr("torch._dynamo.eval_frame", CACHE_ENTRY_LIST)
    return list(get(code)) if get is not None else []


def recompile_limit_value() -> Optional[int]:
    cfg = dynamo_config()
    return getattr(cfg, "recompile_limit", None) or getattr(cfg, "cache_size_limit", None)


def dynamo_counters(kind: str) -> Dict[Any, Any]:
    """One of Dynamo's counters (``torch._dynamo.utils.counters[kind]``, e.g. ``graph_break``)."""
    counters = _dynamo_attr("torch._dynamo.utils", "counters")
    return dict(counters.get(kind, {})) if counters is not None else {}


def compilation_metrics() -> list:
    """Dynamo's per-frame compilation metrics (a capped deque), oldest first; [] where unavailable."""
    return list(_dynamo_attr("torch._dynamo.utils", COMPILATION_METRICS) or ())


def last_compilation_metric() -> Any:
    """The newest record of Dynamo's compilation metrics, or None (one look, no copy: the dense
    path asks it whether anything new was recorded)."""
    metrics = _dynamo_attr("torch._dynamo.utils", COMPILATION_METRICS)
    try:
        return metrics[-1] if metrics else None
    except Exception:
        return None


def guard_failures(code: types.CodeType) -> list:
    """Dynamo's guard-failure reasons recorded for ``code`` (``torch._dynamo.utils.guard_failures``:
    one string per failed cache entry at each recompile, also with Dynamo's logs silenced),
    oldest first; [] where unavailable."""
    table = _dynamo_attr("torch._dynamo.utils", "guard_failures")
    try:
        return list(table.get(code, ())) if table is not None else []
    except Exception:
        return []


def current_compile_id() -> Any:
    """The id of the Dynamo compile running on this thread (``CompileContext``), or None."""
    context = _dynamo_attr("torch._guards", "CompileContext")
    try:
        return context.current_compile_id() if context is not None else None
    except Exception:
        return None


def current_compile() -> Any:
    """The Dynamo compile running on this thread (its ``CompileContext``, one object per frame
    compile: compile ids start again after ``torch._dynamo.reset()``), or None."""
    context = _dynamo_attr("torch._guards", "CompileContext")
    try:
        return context.try_get() if context is not None else None
    except Exception:
        return None


def tracing_here() -> bool:
    """This thread is inside a compile or an export trace: a ``CompileContext`` (Dynamo) or a
    ``TracingContext`` (Dynamo, AOTAutograd, export), both per thread. ``torch.compiler.is_compiling()``
    cannot say it: one process-wide flag, held ``True`` by any thread's compile (2.13+) or export."""
    if current_compile() is not None:
        return True
    context = _dynamo_attr("torch._guards", "TracingContext")
    try:
        return context is not None and context.try_get() is not None
    except Exception:
        return False


def entry_compile_id(entry: Any) -> Any:
    """The compile id of one of Dynamo's cache entries (2.5+), or None."""
    return getattr(entry, "compile_id", None)


FLEX_VARIABLE_MODULE = "torch._dynamo.variables.higher_order_ops"


def flex_trace_method() -> Tuple[type, str]:
    """``(class, method name)``: the method Dynamo runs each time it puts a FlexAttention call
    into a graph (``FlexAttentionHigherOrderVariable._call_function``; ``call_function`` before
    the HOP-context wrapper existed). Runs at trace time only, never when a graph runs."""
    cls = module(FLEX_VARIABLE_MODULE).__dict__.get("FlexAttentionHigherOrderVariable")
    if not isinstance(cls, type):
        raise Unavailable(
            f"recompile pressure is unavailable on torch {torch_version()} "
            f"({FLEX_VARIABLE_MODULE}.FlexAttentionHigherOrderVariable not found)"
        )
    for name in (CALL_FUNCTION, "call_function"):
        if callable(vars(cls).get(name)):
            return cls, name
    raise LookupError("FlexAttentionHigherOrderVariable defines neither _call_function nor call_function")


def is_disable_wrapper(code: types.CodeType) -> bool:
    """``code`` is the wrapper of a ``torch.compiler.disable``d function (``DisableContext``)."""
    qual = getattr(code, "co_qualname", code.co_name)
    return code.co_name == WRAPPER_FN and DISABLE_CONTEXT in qual and code.co_filename.endswith(EVAL_FRAME_FILE)


def is_compile_entry(code: types.CodeType) -> bool:
    """``code`` is the wrapper of a ``torch.compile``d callable: frames inside it run under Dynamo."""
    qual = getattr(code, "co_qualname", code.co_name)
    return code.co_name in (COMPILE_WRAPPER_FN, WRAPPER_FN) and DISABLE_CONTEXT not in qual and code.co_filename.endswith(EVAL_FRAME_FILE)


def compiling_frame() -> Optional[Tuple[Any, types.CodeType]]:
    """``(frame locals, code)`` of the frame Dynamo is compiling on this thread, or None."""
    found = dynamo_frame_graph()
    return (found[0], found[1]) if found is not None else None


def same_object_entries(entries: list, f_locals: Any) -> Optional[int]:
    """How many of a frame's cache entries Dynamo's recompile limit counts for these locals: those
    whose ID_MATCH'd objects (``guard_manager.id_matched_objs``, by local name) are the frame's
    own (``torch._dynamo.cache_size``): 32 layers sharing one ``forward`` with an entry each are
    no recompile. None where the entries do not say."""
    n = 0
    for entry in entries:
        objs = getattr(getattr(entry, "guard_manager", None), "id_matched_objs", None)
        if not isinstance(objs, dict):
            return None
        same = True
        for name, ref in objs.items():
            obj = ref() if callable(ref) else None
            if obj is not None and (not isinstance(f_locals, dict) or f_locals.get(name) is not obj):
                same = False
                break
        n += same
    return n


def id_matched_names(entries: list) -> set:
    """The local names a frame's cache entries match by identity (``id_matched_objs``): Dynamo's
    recompile limit does not count an entry made for another object under these names."""
    names: set = set()
    for entry in entries:
        objs = getattr(getattr(entry, "guard_manager", None), "id_matched_objs", None)
        if isinstance(objs, dict):
            names.update(str(n) for n in objs)
    return names


def compile_callbacks() -> Any:
    """Dynamo's compile start/end callback registry (``register_end_callback``), or None."""
    return _dynamo_attr("torch._dynamo.callback", "callback_handler")


def add_compile_callbacks(start: Any, end: Any) -> bool:
    """Register Dynamo compile start (``start``; None: none) and end callbacks; False where this
    torch has no callback registry."""
    handler = compile_callbacks()
    if handler is None:
        return False
    if start is not None:
        getattr(handler, REGISTER_START_CALLBACK)(start)
    getattr(handler, REGISTER_END_CALLBACK)(end)
    return True


def compile_callback_registered(fn: Any, end: bool = False) -> bool:
    """Is ``fn`` among Dynamo's compile-start (``end``: compile-end) callbacks now?"""
    return fn in getattr(compile_callbacks(), END_CALLBACKS if end else START_CALLBACKS, ())


def remove_compile_callbacks(start: Any, end: Any) -> None:
    """Drop ``start`` / ``end`` from Dynamo's compile callbacks, every copy; nothing if absent."""
    handler = compile_callbacks()
    for name, fn in ((START_CALLBACKS, start), (END_CALLBACKS, end)):
        registered = getattr(handler, name, None)
        while registered is not None and fn in registered:
            registered.remove(fn)


def compile_trigger(args: tuple) -> str:
    """What started the compile a start callback hears about (``"DYNAMO"``; a lazily compiled
    backward or a CUDA graph recording otherwise), ``"DYNAMO"`` where the callback says nothing."""
    return getattr(getattr(args[0], CALLBACK_TRIGGER, None), "name", "DYNAMO") if args else "DYNAMO"


def graph_source(compiled: Any) -> str:
    """The generated Python source of a ``CompiledFxGraph``, or ``""``."""
    return getattr(compiled, SOURCE_CODE, "") or ""


# The frames that call a GraphModule's generated code (nn.Module's call, FX's wrapped call, the
# lazy forward, a backend's closure such as aot_eager's): their locals hold only the module and
# its arguments, so reading them keeps no tensor alive; no other frame's locals are read.
_FX_CALLERS = ("nn/modules/module.py", "fx/", "_dynamo/backends/")
_FX_HOLDERS = ("self", "obj", "fx_g", "gm", "mod")


def running_graph(frame: Any, limit: int = 40) -> Optional[Tuple[Any, int]]:
    """``(GraphModule, line)`` of the FX graph whose generated code is running at or above
    ``frame`` (the nearest), and the line of its code running now; None when none is. The module
    is found in the locals of the few frames of PyTorch's that called that code, never the
    generated frame's own (reading those before Python 3.13 would keep its dead tensors alive)."""
    import torch  # lazy: torch loads on first use, never when this module is imported

    f = frame
    while f is not None and limit > 0 and not f.f_code.co_filename.startswith(FX_CODE_FILE):
        f, limit = f.f_back, limit - 1
    if f is None or limit <= 0:
        return None
    code, line = f.f_code, f.f_lineno
    g, depth = f.f_back, 8
    while g is not None and depth > 0:
        filename = g.f_code.co_filename.replace(os.sep, "/")
        names = [n for n in _FX_HOLDERS if n in g.f_code.co_varnames or n in g.f_code.co_freevars]
        if names and "torch/" in filename and any(part in filename for part in _FX_CALLERS):
            local = g.f_locals
            for n in names:
                gm = local.get(n)
                if isinstance(gm, torch.fx.GraphModule) and getattr(type(gm).forward, "__code__", None) is code:
                    return gm, line
        g, depth = g.f_back, depth - 1
    return None


def module_stack(meta: Any) -> Any:
    """An FX node's module stack: its own, or on a backward node its forward's; {} if none."""
    return meta.get("nn_module_stack") or meta.get(FWD_NN_MODULE_STACK) or {}


def hook_guards_skipped() -> bool:
    """Dynamo installs no guard on an empty nn.Module hook dict (``skip_nnmodule_hook_guards``,
    its default): hooks absent while it compiles and present afterwards recompile nothing."""
    return bool(getattr(dynamo_config(), "skip_nnmodule_hook_guards", False))


def skip_frames(codes: Any, skip: bool = True) -> bool:
    """Dynamo's frame callback runs these code objects, and whatever they call, without compiling
    them (``FrameExecStrategy(SKIP, SKIP)``; ``skip=False``: back to the default); a traced
    frame calling them still inlines them. False where this torch lacks it."""
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy  # lazy: a release may lack it; looked up on first use
        from torch._dynamo.types import FrameAction, FrameExecStrategy  # (as above)

        action = FrameAction.SKIP if skip else FrameAction.DEFAULT
        for code in codes:
            set_code_exec_strategy(code, FrameExecStrategy(action, action))
        return True
    except Exception:
        return False


def lookup_backend(name: str) -> Any:
    """A ``torch.compile`` backend by name (``"inductor"``, ``"eager"``)."""
    return module("torch._dynamo.backends.registry").lookup_backend(name)


def structured_trace() -> Optional[Tuple[Any, Any]]:
    """``(trace_log, trace_structured)``: PyTorch's structured trace (TORCH_TRACE, tlparse), or None."""
    log = _dynamo_attr("torch._logging._internal", "trace_log")
    emit = _dynamo_attr("torch._logging", "trace_structured")
    return (log, emit) if log is not None and emit is not None else None


def register_torch_log(alias: str, qname: str) -> Optional[Callable[[], None]]:
    """Register the logger ``qname`` with ``torch._logging`` as ``alias``, as PyTorch registers
    its own components, so ``TORCH_LOGS=alias`` / ``+alias`` / ``-alias`` and
    ``torch._logging.set_logs(alias=level)`` set its level (and give it PyTorch's handler and
    format). Returns the undo: the alias goes, and if ``torch._logging`` configured the logger
    meanwhile (``set_logs``), its handlers go and the level and propagation come back. None when
    torch knows the alias already (``TORCH_LOGS`` named it when torch was imported: it is torch's
    then)."""
    internal = module("torch._logging._internal")
    register = getattr(internal, "register_log", None)
    aliases = getattr(getattr(internal, "log_registry", None), "log_alias_to_log_qnames", None)
    if not callable(register) or not isinstance(aliases, dict):
        raise Unavailable(
            f"TORCH_LOGS={alias} is unavailable on torch {torch_version()} "
            "(torch._logging._internal.register_log / log_registry not found); "
            f'logging.getLogger("{qname}") works as usual'
        )
    if alias in aliases:
        return None
    register(alias, qname)
    logger = logging.getLogger(qname)
    before = (logger.level, logger.propagate)
    is_torch_handler = getattr(internal, IS_TORCH_HANDLER, None)

    def undo() -> None:
        aliases.pop(alias, None)
        theirs = [h for h in logger.handlers if callable(is_torch_handler) and is_torch_handler(h)]
        if theirs:
            for handler in theirs:
                logger.removeHandler(handler)
            logger.setLevel(before[0])
            logger.propagate = before[1]

    return undo


def torch_log_registered(alias: str) -> bool:
    """``alias`` is a log name of ``torch._logging`` (``TORCH_LOGS`` / ``set_logs`` accept it)."""
    registry = _dynamo_attr("torch._logging._internal", "log_registry")
    return bool(registry is not None and registry.is_log(alias))
