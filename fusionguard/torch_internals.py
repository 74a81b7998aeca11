"""Find PyTorch's FlexAttention choke points by introspection, with clear reasons when missing.

Everything version-specific about *where* things live is in this file. Each finder returns the
object or raises ``LookupError`` with a sentence that says what was looked for, so ``enable()`` can
report what it could not patch instead of failing.
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
from typing import Any, Callable, Dict, Optional, Tuple

HOP_MODULE = "torch._higher_order_ops.flex_attention"
PUBLIC_MODULE = "torch.nn.attention.flex_attention"
LOWERING_MODULE = "torch._inductor.lowering"
FLEX_LOWERING_MODULES = ("torch._inductor.kernel.flex.flex_attention", "torch._inductor.kernel.flex_attention")
OUTPUT_CODE_MODULES = ("torch._inductor.output_code", "torch._inductor.codecache")

# Functions inside the Inductor flex lowering module that choose a non-default template.
# Looked up by name; any that a version lacks is simply not observed.
TEMPLATE_SELECTORS = {
    "lower_cpu": "cpp",
    "create_flex_decoding_kernel": "triton_decode",
    "create_flex_flash_attention_kernel": "flash",
    "create_flex_flash_attention_backward_kernel": "flash",
    "lower_mps": "mps",
}


def module(name: str) -> types.ModuleType:
    # Not ``import a.b as m``: torch._higher_order_ops re-exports the operator under the
    # module's own name, so attribute access would give the operator, not the module.
    mod = sys.modules.get(name)
    return mod if mod is not None else importlib.import_module(name)


def _first_module(names: tuple) -> types.ModuleType:
    errors = []
    for name in names:
        try:
            return module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise LookupError("none of these modules imports: " + "; ".join(errors))


def hop(name: str) -> Any:
    """The ``flex_attention`` / ``flex_attention_backward`` higher-order operator."""
    mod = module(HOP_MODULE)
    op = mod.__dict__.get(name)
    if op is None or not hasattr(op, "py_kernels"):
        raise LookupError(f"{HOP_MODULE}.{name} is not a higher-order operator with py_kernels")
    return op


def dense_key() -> Any:
    import torch

    return torch._C.DispatchKey.CompositeExplicitAutograd


def dense_kernel(op: Any) -> Any:
    kernels = op.py_kernels
    key = dense_key()
    if key not in kernels:
        raise LookupError(f"{op} has no CompositeExplicitAutograd py_kernel (the dense implementation)")
    return kernels[key]


def clear_dispatch_cache(op: Any) -> None:
    # HigherOrderOperator caches the resolved kernel per dispatch key: a replaced py_kernels entry
    # is invisible until the cache is cleared.
    cache = getattr(op, "_dispatch_cache", None)
    if cache is not None:
        cache.clear()


def autograd_op() -> type:
    mod = module(HOP_MODULE)
    cls = mod.__dict__.get("FlexAttentionAutogradOp")
    if not isinstance(cls, type):
        raise LookupError(f"{HOP_MODULE}.FlexAttentionAutogradOp not found")
    for name in ("forward", "backward"):
        if not isinstance(vars(cls).get(name), staticmethod):
            raise LookupError(f"FlexAttentionAutogradOp.{name} is not a staticmethod defined on the class")
    return cls


def lowerings() -> Dict[Any, Any]:
    mod = module(LOWERING_MODULE)
    _first_module(FLEX_LOWERING_MODULES)  # registers the flex lowerings
    table = getattr(mod, "lowerings", None)
    if not isinstance(table, dict):
        raise LookupError(f"{LOWERING_MODULE}.lowerings is not a dict")
    return table


def flex_lowering_module() -> types.ModuleType:
    # Inductor's lowering module first: on torch 2.7 importing the flex kernel module before it
    # is a circular import that leaves Inductor unable to lower flex_attention ("not an OpOverload")
    module(LOWERING_MODULE)
    return _first_module(FLEX_LOWERING_MODULES)


def compiled_fx_graph() -> type:
    """The class whose ``post_compile`` runs after every Inductor compile *and* cache hit."""
    for name in OUTPUT_CODE_MODULES:
        try:
            cls = module(name).__dict__.get("CompiledFxGraph")
        except ImportError:
            continue
        if isinstance(cls, type) and "post_compile" in vars(cls):
            return cls
    raise LookupError("torch._inductor CompiledFxGraph.post_compile not found")


def optimized_module() -> type:
    """``torch.compile(module)``'s wrapper class (``OptimizedModule``), which holds the compiled
    module as ``_orig_mod``."""
    cls = module("torch._dynamo.eval_frame").__dict__.get("OptimizedModule")
    if isinstance(cls, type) and "__init__" in vars(cls):
        return cls
    raise LookupError("torch._dynamo.eval_frame.OptimizedModule.__init__ not found")


def public_module() -> Optional[types.ModuleType]:
    try:
        return module(PUBLIC_MODULE)
    except ImportError:
        return None


def debug_flag_on() -> bool:
    mod = sys.modules.get(PUBLIC_MODULE)
    return bool(mod is not None and getattr(mod, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", False))


def _functional_checks() -> tuple:
    import torch

    functional = getattr(torch, "_is_functional_tensor", None) or getattr(torch._C, "_is_functional_tensor", None)
    wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
    return functional, wrapped


_FUNCTIONAL: Optional[tuple] = None


def is_concrete(t: Any) -> bool:
    """True for a tensor whose kernel really computes (not fake, functional, meta or a proxy)."""
    import torch

    global _FUNCTIONAL
    if _FUNCTIONAL is None:
        _FUNCTIONAL = _functional_checks()
    functional, wrapped = _FUNCTIONAL
    if type(t) is torch.Tensor and functional is not None and wrapped is not None:
        # the common case, checked first (it is on the dense path): not a subclass, so not fake
        # itself; functorch (vmap / grad) wrappers and functional tensors take the long way
        try:
            if not wrapped(t) and not functional(t):
                return not t.is_meta
        except Exception:
            pass
    if not isinstance(t, torch.Tensor):
        return False
    try:
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(t):
            return False
    except Exception:
        pass
    try:
        from torch._subclasses.functional_tensor import FunctionalTensor

        if isinstance(t, FunctionalTensor):
            return False
    except Exception:
        pass
    try:
        if functional is not None and functional(t):
            return False
    except Exception:
        pass
    if t.is_meta:
        return False
    return True


def dynamo_frame_graph() -> Optional[tuple]:
    """During a Dynamo compile: ``(frame locals, code, FX graph)`` of the frame being compiled (real
    objects; the graph's nodes carry ``nn_module_stack``). None outside one (a backward compiled
    lazily at its first run, a graph loaded before ``enable()``) or where this torch keeps them
    elsewhere."""
    mod = sys.modules.get("torch._dynamo.symbolic_convert")
    cls = getattr(mod, "InstructionTranslator", None) if mod is not None else None
    current = getattr(cls, "current_tx", None)
    if current is None:
        return None
    try:
        tx = current()
        return tx.f_locals, tx.f_code, tx.output.graph
    except Exception:  # no frame being compiled on this thread
        return None


AOT_RUNTIME_DIR = "_aot_autograd"  # in the path of the file where AOTAutograd's autograd.Function runs


def found_compiled_graphs() -> list:
    """Every live ``CompiledFxGraph`` of this process (the Inductor output of each compiled
    graph), by a scan of the garbage collector's objects: the graphs Dynamo keeps for code that
    was compiled before fusionguard was enabled."""
    import gc
    import itertools
    import operator

    if not _inductor_code_loaded():
        return []  # no Inductor output was ever loaded: nothing to find, no scan
    cls = compiled_fx_graph()
    objects = gc.get_objects()
    try:  # (all in C: about half the time of a Python loop over ~500k objects)
        return list(itertools.compress(objects, map(operator.is_, map(type, objects), itertools.repeat(cls))))
    finally:
        del objects


def _inductor_code_loaded() -> bool:
    """False when Inductor's code cache holds no module: every compiled graph's code is loaded
    through it (only clearing it, as ``torch._inductor.utils.fresh_cache()`` does, could hide a
    live graph); True when unsure."""
    mod = sys.modules.get("torch._inductor.codecache")
    cache = getattr(mod, "PyCodeCache", None) if mod is not None else None
    if cache is None:
        return mod is not None
    tables = [getattr(cache, n) for n in ("modules", "cache", "modules_no_attr") if hasattr(cache, n)]
    return not tables or any(bool(t) for t in tables)


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
    return getattr(_dynamo_attr("torch._dynamo.eval_frame", "_stance"), "stance", None)


def cache_entries(code: types.CodeType) -> list:
    """Dynamo's cache entries (one per compiled version) for ``code``; [] where unavailable."""
    get = _dynamo_attr("torch._dynamo.eval_frame", "_debug_get_cache_entry_list")
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
    return list(_dynamo_attr("torch._dynamo.utils", "_compilation_metrics") or ())


def last_compilation_metric() -> Any:
    """The newest record of Dynamo's compilation metrics, or None (one look, no copy: the dense
    path asks it whether anything new was recorded)."""
    metrics = _dynamo_attr("torch._dynamo.utils", "_compilation_metrics")
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
    for name in ("_call_function", "call_function"):
        if callable(vars(cls).get(name)):
            return cls, name
    raise LookupError("FlexAttentionHigherOrderVariable defines neither _call_function nor call_function")


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


def compile_callbacks() -> Any:
    """Dynamo's compile start/end callback registry (``register_end_callback``), or None."""
    return _dynamo_attr("torch._dynamo.callback", "callback_handler")


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
    is_torch_handler = getattr(internal, "_is_torch_handler", None)

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


# --- Version differences, each behind one lookup (torch 2.6 ... 2.15) -------------------------


class Unavailable(LookupError):
    """This torch release lacks the feature (nothing failed): ``enable()`` names it in one line,
    ``not_patched`` records it and the tests skip by it."""


def torch_version() -> str:
    import torch

    return str(torch.__version__).split("+")[0]


def setup_compilation_env_home() -> Dict[str, Any]:
    """The namespace holding ``setup_compilation_env`` (from 2.11), the context manager that
    yields the backend of PyTorch's eager flex_attention compile: rescue's seam."""
    mod = public_module()
    if mod is None or not callable(mod.__dict__.get("setup_compilation_env")):
        raise Unavailable(
            f"rescue=True is unavailable on torch {torch_version()} "
            f"({PUBLIC_MODULE}.setup_compilation_env, added in 2.11, is missing)"
        )
    return mod.__dict__


def has_debug_flag() -> bool:
    """``_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG`` exists (from 2.9)."""
    mod = public_module()
    return mod is not None and "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG" in mod.__dict__


def recompile_limit_option() -> str:
    """Dynamo's per-frame recompile limit: ``recompile_limit`` from 2.7, ``cache_size_limit`` on 2.6
    (2.7+ keeps that name as an alias)."""
    import torch._dynamo

    return "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


def backend_name(backend: Any) -> Optional[str]:
    """A Dynamo backend's name: ``inductor``, ``aot_eager``, or the function's own name."""
    if backend is None:
        return None
    if isinstance(backend, str):
        return backend
    return getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None) or repr(backend)


def _unwrap_backend(callback: Any) -> Any:
    """Dynamo's frame callback wraps the backend in converters that keep it as
    ``_torchdynamo_orig_backend`` (2.8+) or ``_torchdynamo_orig_callable`` (2.6, 2.7)."""
    for _ in range(10):
        inner = getattr(callback, "_torchdynamo_orig_backend", None) or getattr(callback, "_torchdynamo_orig_callable", None)
        if inner is None or inner is callback:
            break
        callback = inner
    return callback


def compiled_code_backend(code: types.CodeType, orig: types.CodeType, entry_frame: Optional[types.FrameType]) -> Any:
    """The backend that compiled ``code`` (Dynamo's transformed version of ``orig``).

    From 2.11 its cache entry says (``CacheEntry.backend``); before, the ``torch.compile``
    wrapper frame that was running it (``entry_frame``, the innermost one outside the compiled
    frame) holds the Dynamo callback around the backend."""
    for entry in cache_entries(orig):
        if entry.code is code and hasattr(entry, "backend"):
            return entry.backend
    if entry_frame is not None:
        callback = entry_frame.f_locals.get("callback")
        if callback is not None:
            return _unwrap_backend(callback)
    return None


def compiled_graph_text(compiled: Any) -> str:
    """The post-grad FX graph Inductor keeps with a ``CompiledFxGraph`` (2.7+), or ``""``."""
    return getattr(compiled, "inductor_post_grad_graph_str", None) or getattr(compiled, "runnable_graph_str", None) or ""


def dynamo_skips_frames(fn: Any, nested: bool) -> bool:
    """Tell Dynamo's frame hook never to compile ``fn``'s own frames (``nested``: nor any frame
    they call, as for a compiled graph's own calls), per code object, at no per-call cost. How
    Dynamo inlines ``fn`` when it traces a caller is unchanged. False where this torch has no such
    switch (``set_code_exec_strategy``, 2.7+)."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:
        return False
    action = _FrameAction.SKIP if nested else _FrameAction.DEFAULT
    set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, action))
    return True


def eval_frame_callback() -> Callable[[], Any]:
    """Dynamo's C function that returns the frame hook set on this thread (None or False when
    none): a C call, so no Python frame of ours for that hook to see."""
    try:
        return module("torch._C._dynamo.eval_frame").get_eval_frame_callback
    except (ImportError, AttributeError):
        return lambda: None


def is_fullgraph_hook(callback: Any) -> bool:
    """``callback`` (a set frame hook) compiles every new frame with ``fullgraph=True``.

    That is the hook below PyTorch's internal ``torch.compile(fullgraph=True)`` flex_attention
    wrapper when Dynamo runs that wrapper uncompiled (torch 2.7, for the rest of the process once a
    compile of it was skipped, e.g. with Dynamo disabled): every frame below it not seen before is
    compiled that way, and the guard's frames cannot be (they leave the graph on purpose). False
    when unsure."""
    inner = getattr(callback, "_torchdynamo_orig_callable", None)  # CatchErrorsWrapper -> ConvertFrameAssert
    return getattr(inner, "_one_graph", None) is True


def graph_cache_key(compiled: Any) -> Optional[str]:
    """The FX graph cache key of a ``CompiledFxGraph`` (``cache_key``; ``_fx_graph_cache_key`` on
    older releases), or None."""
    return getattr(compiled, "cache_key", None) or getattr(compiled, "_fx_graph_cache_key", None)


NJT_MODULE = "torch.nested._internal.ops"
_NJT_CODES: tuple = ()


def nested_flex_codes() -> tuple:
    """Code objects of the jagged NestedTensor FlexAttention implementations (``flex_njt``,
    ``flex_njt_backward``; 2.7 to 2.12), which run the dense kernel on the packed values: the
    kernel itself sees a plain tensor. Empty where none exists or no NestedTensor was made."""
    global _NJT_CODES
    if not _NJT_CODES:
        mod = sys.modules.get(NJT_MODULE)
        if mod is not None:
            codes = []  # a loop, not a generator: no new frame on the dense path (a frame hook sees those)
            for name, fn in list(vars(mod).items()):
                if name.startswith("flex_njt") and hasattr(fn, "__code__"):
                    codes.append(fn.__code__)
            _NJT_CODES = tuple(codes)
    return _NJT_CODES


# --- watch() and compiled graphs (watching/, inductor.py, compiled.py) -------------------------


def graph_task_id() -> Any:
    """A function returning the id of the autograd backward pass running on this thread, -1
    outside one (``torch._C._current_graph_task_id``); on a torch without it, always -1."""
    import torch

    return getattr(torch._C, "_current_graph_task_id", None) or (lambda: -1)


def at_trace_time(fn: Any) -> Any:
    """``fn`` (no arguments, returns an int) run for real when Dynamo traces a call to it, the
    result baked into the graph as a constant (``torch._dynamo.assume_constant_result``);
    without that Dynamo support, a function that does nothing."""
    try:
        import torch._dynamo

        return torch._dynamo.assume_constant_result(fn)
    except Exception:  # pragma: no cover - very old torch
        return lambda: 0


FORWARD_PRE_HOOKS = "_forward_pre_hooks"  # the key of nn.Module's forward pre-hook dict in its __dict__


def is_compile_wrapper(module: Any) -> bool:
    """``torch.compile(module)``'s ``OptimizedModule``: it holds the module as ``_orig_mod``."""
    return hasattr(module, "_orig_mod") and hasattr(module, "_torchdynamo_orig_callable")


def compiled_in_place(module: Any) -> bool:
    """``module.compile()`` was called: its ``__call__`` runs a compiled ``_call_impl``."""
    return getattr(module, "_compiled_call_impl", None) is not None


def wrapped_module(wrapper: Any) -> Any:
    """The module an ``OptimizedModule`` (being built) wraps; None for ``torch.compiler.disable(module)``,
    the same class around a ``DisableContext``, which compiles nothing."""
    attrs = wrapper.__dict__
    if type(attrs.get("dynamo_ctx")).__name__ == "DisableContext":
        return None
    return attrs.get("_orig_mod") or attrs.get("_modules", {}).get("_orig_mod")


def lowering_node() -> Any:
    """The FX node Inductor is lowering now (``V.graph.current_node``), or None."""
    from torch._inductor.virtualized import V

    return getattr(V.graph, "current_node", None)


def inductor_cache_dir() -> str:
    """Inductor's cache directory (``cache_dir()``: ``runtime.cache_dir_utils``, earlier
    ``runtime.runtime_utils``)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # older layout
        from torch._inductor.runtime.runtime_utils import cache_dir
    return str(cache_dir())


def profiler_check() -> Callable[[], bool]:
    """A cheap "is a profiler recording?" for the run-time wrappers (fusionguard.eventlog.profiler):
    ``torch.autograd.profiler._is_profiler_enabled``, the flag ``torch.profiler`` sets (a module
    attribute read, about 0.06 us; an idle ``record_function`` costs about 13 us), else the C
    function behind it (``torch._C._autograd._profiler_enabled``), else never (no ranges)."""
    try:
        prof = module("torch.autograd.profiler")
    except ImportError:
        prof = None
    if prof is not None and isinstance(getattr(prof, "_is_profiler_enabled", None), bool):
        return lambda: prof._is_profiler_enabled
    try:
        fn = module("torch._C._autograd")._profiler_enabled
        if callable(fn) and isinstance(fn(), bool):
            return fn
    except (ImportError, AttributeError):
        pass
    return lambda: False


def attn_implementation(model: Any) -> Optional[str]:
    """A Hugging Face model's attention backend (``config._attn_implementation``: transformers has
    no public name for it), or None. Kept here with the other private names."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return impl if isinstance(impl, str) else None


def mask_home() -> Dict[str, Any]:
    """The namespace whose ``create_mask`` global ``create_block_mask`` calls (the mask hook's
    seam: every ``create_block_mask``, however it was imported, looks it up there)."""
    mod = public_module()
    if mod is None or not callable(mod.__dict__.get("create_mask")) or not callable(mod.__dict__.get("create_block_mask")):
        raise Unavailable(f"mask builds are not observed on torch {torch_version()} ({PUBLIC_MODULE}.create_mask is missing)")
    return mod.__dict__


def create_block_mask_code() -> Any:
    """``create_block_mask``'s code object (to tell its ``create_mask`` call from a direct one)."""
    mod = public_module()
    fn = mod.__dict__.get("create_block_mask") if mod is not None else None
    fn = getattr(fn, "__wrapped__", fn)
    return getattr(fn, "__code__", None)


def block_sizes(frame: Any) -> Tuple[int, int]:
    """The (Q, KV) sparse block sizes ``create_block_mask`` (``frame``) is building with; its
    locals ``Q_BLOCK_SIZE`` / ``KV_BLOCK_SIZE``, else the module default (128)."""
    try:
        local = frame.f_locals
        return int(local["Q_BLOCK_SIZE"]), int(local["KV_BLOCK_SIZE"])
    except Exception:
        mod = public_module()
        size = int(getattr(mod, "_DEFAULT_SPARSE_BLOCK_SIZE", 128))
        return size, size
