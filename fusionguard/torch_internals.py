"""Find PyTorch's FlexAttention choke points by introspection, with clear reasons when missing.

Everything version-specific about *where* things live is in this file. Each finder returns the
object or raises ``LookupError`` with a sentence that says what was looked for, so ``enable()`` can
report what it could not patch instead of failing.

Every private PyTorch name fusionguard spells (attributes, dict keys, function and parameter
names it looks for) is registered in ``PRIVATE_NAMES`` below, with whose it is; other modules
use the constants and the lookups here, never the names (tests/test_wiring.py checks it).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
import sys
import os
import types
from typing import Any, Callable, Dict, Optional, Tuple
import gc
import itertools
import operator

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


# --- The registry of PyTorch's private names -------------------------------------------------

#: name -> whose it is and why fusionguard spells it: every underscore-prefixed one, and the
#: non-underscore internals (no public API) the rest of the package needs. tests/test_wiring.py
#: catches a new underscore name anywhere else; a new non-underscore internal only once it is
#: registered here: register it when you first use it.
PRIVATE_NAMES: Dict[str, str] = {}


def _private(name: str, why: str) -> str:
    """Register one of PyTorch's private names (``why``: the object it belongs to, what for)."""
    PRIVATE_NAMES[name] = why
    return name


# torch's own modules, reached as attributes
TORCH_C = _private("_C", "torch._C: the C extension module")
DYNAMO = _private("_dynamo", "torch._dynamo: Dynamo, reached as an attribute of torch")
FUNCTORCH_C = _private("_functorch", "torch._C._functorch: functorch's C functions (is a tensor a vmap/grad wrapper)")
IS_FUNCTIONAL_TENSOR = _private("_is_functional_tensor", "torch._is_functional_tensor / torch._C's: a functionalization wrapper")
GRAPH_TASK_ID = _private("_current_graph_task_id", "torch._C: the id of the backward pass running on this thread")
PROFILER_FLAG = _private("_is_profiler_enabled", "torch.autograd.profiler: the flag torch.profiler sets")
PROFILER_ENABLED = _private("_profiler_enabled", "torch._C._autograd: the C function behind that flag")
# the FlexAttention operators and their dense kernels
PY_KERNELS = _private("py_kernels", "HigherOrderOperator: its Python kernels by dispatch key (the dense kernel's seam)")
DISPATCH_CACHE = _private("_dispatch_cache", "HigherOrderOperator: the kernel resolved per dispatch key")
DENSE_FORWARD = _private("sdpa_dense", "torch._higher_order_ops.flex_attention: the dense forward kernel")
DENSE_BACKWARD = _private("sdpa_dense_backward", "torch._higher_order_ops.flex_attention: the dense backward kernel")
MATH_ATTENTION = _private("math_attention", "torch._higher_order_ops.flex_attention: the dense forward's arithmetic")
MATH_ATTENTION_INNER = _private("_math_attention_inner", "torch._higher_order_ops.flex_attention: inside math_attention")
FLEX_HOP_WRAPPER = _private("_flex_attention_hop_wrapper", "torch.nn.attention.flex_attention: the wrapper its internal compile compiles")
DEBUG_FLAG = _private("_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", "torch.nn.attention.flex_attention: run flex eagerly to debug (2.9+)")
DEFAULT_BLOCK_SIZE = _private("_DEFAULT_SPARSE_BLOCK_SIZE", "torch.nn.attention.flex_attention: the block size of create_block_mask")
IDENTITY_SCORE_MOD = _private("_identity", "torch.nn.attention.flex_attention: the no-op score_mod flex_attention defaults to")
MASK_COMPILE_FLAG = _private("_compile", "create_block_mask's parameter that compiled the build (deprecated from 2.13)")
SETUP_COMPILATION_ENV = _private("setup_compilation_env", "torch.nn.attention.flex_attention: yields the backend of its eager compile (2.11+)")
# Inductor's compiled graphs
POST_COMPILE = _private("post_compile", "CompiledFxGraph: runs after every Inductor compile and cache hit (patched)")
CURRENT_CALLABLE = _private("current_callable", "CompiledFxGraph: the callable every run of the graph goes through (wrapped)")
POST_GRAD_GRAPH_STR = _private("inductor_post_grad_graph_str", "CompiledFxGraph: the post-grad FX graph's text (2.7+)")
RUNNABLE_GRAPH_STR = _private("runnable_graph_str", "CompiledFxGraph: the runnable FX graph's text")
SOURCE_CODE = _private("source_code", "CompiledFxGraph: the generated module's Python source")
FWD_NN_MODULE_STACK = _private("fwd_nn_module_stack", "an FX node's meta: the forward's module stack, on a backward node")
START_CALLBACKS = _private("start_callbacks", "torch._dynamo.callback's handler: the compile-start callbacks")
END_CALLBACKS = _private("end_callbacks", "torch._dynamo.callback's handler: the compile-end callbacks")
REGISTER_START_CALLBACK = _private("register_start_callback", "torch._dynamo.callback's handler: add a compile-start callback")
REGISTER_END_CALLBACK = _private("register_end_callback", "torch._dynamo.callback's handler: add a compile-end callback")
REMOVE_END_CALLBACK = _private("remove_end_callback", "torch._dynamo.callback's handler: drop a compile-end callback")
CALLBACK_TRIGGER = _private("callback_trigger", "torch._dynamo.callback's CallbackArgs: what started the compile (DYNAMO, a lazy backward, a CUDA graph)")
CUDAGRAPH_INFO = _private("cudagraph_info", "CompiledFxGraph: set when the graph runs as CUDA graphs")
FX_GRAPH_CACHE_KEY = _private("_fx_graph_cache_key", "CompiledFxGraph: the FX graph cache key on older releases (cache_key later)")
# Dynamo
ORIG_MOD = _private("_orig_mod", "OptimizedModule (torch.compile(module)): the compiled module")
ORIG_CALLABLE = _private("_torchdynamo_orig_callable", "OptimizedModule / Dynamo's frame callback: what it wraps")
ORIG_BACKEND = _private("_torchdynamo_orig_backend", "Dynamo's frame callback: the backend it wraps (2.8+)")
ONE_GRAPH = _private("_one_graph", "ConvertFrameAssert: compiles with fullgraph=True")
STANCE = _private("_stance", "torch._dynamo.eval_frame: torch.compiler.set_stance's stance")
CACHE_ENTRY_LIST = _private("_debug_get_cache_entry_list", "torch._dynamo.eval_frame: a code object's cache entries")
COMPILATION_METRICS = _private("_compilation_metrics", "torch._dynamo.utils: the per-frame compilation metrics")
CALL_FUNCTION = _private("_call_function", "FlexAttentionHigherOrderVariable: puts a flex call into a graph")
DISABLE_CONTEXT = _private("DisableContext", "torch._dynamo.eval_frame: the class of torch.compiler.disable's wrapper")
EVAL_FRAME_FILE = _private("eval_frame.py", "torch._dynamo.eval_frame's file: where the compile and disable wrappers run")
WRAPPER_FN = _private("_fn", "torch._dynamo.eval_frame: the function of the compile and disable wrappers")
COMPILE_WRAPPER_FN = _private("compile_wrapper", "torch._dynamo.eval_frame: the function of the torch.compile wrapper (newer releases)")
IS_TORCH_HANDLER = _private("_is_torch_handler", "torch._logging._internal: a handler torch._logging added")
# torch.fx
FX_CODE_FILE = _private("<eval_with_key>", "torch.fx.graph_module: how the file name of a GraphModule's generated code begins")
# AOTAutograd
AOT_RUNTIME_DIR = _private("_aot_autograd", "torch._functorch._aot_autograd: the directory of AOTAutograd's runtime")
BACKWARD_IMPL = _private("_backward_impl", "AOTAutograd's runtime wrappers: runs the compiled backward")
FWD_FN = _private("_fwd_fn", "AOTAutograd's runtime wrappers (some releases): the forward")
BWD_FN = _private("_bwd_fn", "AOTAutograd's runtime wrappers (some releases): the backward")
CALL_COMPILED_BACKWARD = _private("call_compiled_backward", "AOTAutograd's runtime wrappers (some releases): runs a compiled backward")
# autograd
ENGINE_RUN_BACKWARD = _private("_engine_run_backward", "torch.autograd.graph: the frame of every backward pass")
# nn.Module and its hooks
MODULES = _private("_modules", "nn.Module: its children, in its __dict__")
FORWARD_PRE_HOOKS = _private("_forward_pre_hooks", "nn.Module: its forward pre-hook dict, in its __dict__")
COMPILED_CALL_IMPL = _private("_compiled_call_impl", "nn.Module: set by module.compile()")
HOOKS_DICT_REF = _private("hooks_dict_ref", "RemovableHandle: a weak reference to the dict holding the hook")
EXTRA_DICT_REF = _private("extra_dict_ref", "RemovableHandle: weak references to the dicts of the hook's flags (with_kwargs, always_call)")
# context parallelism for FlexAttention (torchtitan's path: the public context_parallel() patches SDPA only)
CP_MODULES = (
    "torch.distributed.tensor.experimental._context_parallel._attention",  # 2.11 and 2.13 (checked)
    "torch.distributed.tensor.experimental._attention",  # earlier releases, and a re-export stub later
)
CONTEXT_PARALLEL = _private("_ContextParallel", "torch.distributed.tensor.experimental: ParallelStyle; AttentionType.FLEX all-gathers K/V")
CP_BLOCK_MASK = _private("_create_cp_block_mask", "torch.distributed.tensor.experimental: a rank's BlockMask, local Q against the whole KV")
CP_SHARD = _private("_context_parallel_shard", "torch.distributed.tensor.experimental: shards buffers along the sequence as the mask expects")
FSDP_WRAPPED_MODULE = _private("_fsdp_wrapped_module", "FullyShardedDataParallel (FSDP1): the wrapped module")
CHECKPOINT_WRAPPED_MODULE = _private("_checkpoint_wrapped_module", "CheckpointWrapper (activation checkpointing): the wrapped module")

#: The attributes through which wrappers hold the wrapped module: DDP (``module``, public),
#: torch.compile, FSDP1, activation checkpointing.
WRAPPER_ATTRS = frozenset({"module", ORIG_MOD, FSDP_WRAPPED_MODULE, CHECKPOINT_WRAPPED_MODULE})
#: ``_orig_mod`` as one part of a dotted module name (``_orig_mod.layers.0``).
ORIG_MOD_PART = re.compile(rf"(^|\.){ORIG_MOD}(?=\.|$)")
#: Functions of the FlexAttention dense implementation (frames that mean "inside the dense kernel").
DENSE_FUNCTIONS = frozenset({DENSE_FORWARD, DENSE_BACKWARD, MATH_ATTENTION, MATH_ATTENTION_INNER})
#: The functions of AOTAutograd's runtime whose frames hold its autograd ``ctx``.
AOT_CTX_FUNCTIONS = ("forward", "backward", BACKWARD_IMPL, FWD_FN, BWD_FN, CALL_COMPILED_BACKWARD)


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
    if op is None or not hasattr(op, PY_KERNELS):
        raise LookupError(f"{HOP_MODULE}.{name} is not a higher-order operator with py_kernels")
    return op


def dense_key() -> Any:
    import torch  # lazy: torch loads on first use, never when this module is imported

    return torch._C.DispatchKey.CompositeExplicitAutograd


def op_kernels(op: Any) -> Dict[Any, Any]:
    """A higher-order operator's Python kernels by dispatch key (the dense kernel's seam)."""
    return getattr(op, PY_KERNELS)


def dense_kernel(op: Any) -> Any:
    kernels = op_kernels(op)
    key = dense_key()
    if key not in kernels:
        raise LookupError(f"{op} has no CompositeExplicitAutograd py_kernel (the dense implementation)")
    return kernels[key]


def clear_dispatch_cache(op: Any) -> None:
    # HigherOrderOperator caches the resolved kernel per dispatch key: a replaced py_kernels entry
    # is invisible until the cache is cleared.
    cache = getattr(op, DISPATCH_CACHE, None)
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
    return bool(mod is not None and getattr(mod, DEBUG_FLAG, False))


def _functional_checks() -> tuple:
    import torch  # lazy: torch loads on first use, never when this module is imported

    functional = getattr(torch, IS_FUNCTIONAL_TENSOR, None) or getattr(torch._C, IS_FUNCTIONAL_TENSOR, None)
    wrapped = getattr(getattr(torch._C, FUNCTORCH_C, None), "is_functorch_wrapped_tensor", None)
    return functional, wrapped


_FUNCTIONAL: Optional[tuple] = None


def is_concrete(t: Any) -> bool:
    """True for a tensor whose kernel really computes (not fake, functional, meta or a proxy)."""
    import torch  # lazy: torch loads on first use, never when this module is imported

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
        from torch._subclasses.fake_tensor import is_fake  # lazy: torch loads on first use, never when this module is imported

        if is_fake(t):
            return False
    except Exception:
        pass
    try:
        from torch._subclasses.functional_tensor import FunctionalTensor  # lazy: torch loads on first use, never when this module is imported

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


def found_compiled_graphs() -> list:
    """Every live ``CompiledFxGraph`` of this process (the Inductor output of each compiled
    graph), by a scan of the garbage collector's objects: the graphs Dynamo keeps for code that
    was compiled before fusionguard was enabled."""

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
    return (
        code.co_name in (COMPILE_WRAPPER_FN, WRAPPER_FN)
        and DISABLE_CONTEXT not in qual
        and code.co_filename.endswith(EVAL_FRAME_FILE)
    )


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


# --- Version differences, each behind one lookup (torch 2.6 ... 2.15) -------------------------


class Unavailable(LookupError):
    """This torch release lacks the feature (nothing failed): ``enable()`` names it in one line,
    ``not_patched`` records it and the tests skip by it."""


def torch_version() -> str:
    import torch  # lazy: torch loads on first use, never when this module is imported

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
    return mod is not None and DEBUG_FLAG in mod.__dict__


def recompile_limit_option() -> str:
    """Dynamo's per-frame recompile limit: ``recompile_limit`` from 2.7, ``cache_size_limit`` on 2.6
    (2.7+ keeps that name as an alias)."""
    import torch._dynamo  # lazy: torch loads on first use, never when this module is imported

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
        inner = getattr(callback, ORIG_BACKEND, None) or getattr(callback, ORIG_CALLABLE, None)
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


def compiled_graph_text(compiled: Any, source: bool = False) -> str:
    """The post-grad FX graph Inductor keeps with a ``CompiledFxGraph`` (2.7+), or ``""``;
    ``source``: else the graph's generated Python code."""
    text = getattr(compiled, POST_GRAD_GRAPH_STR, None) or getattr(compiled, RUNNABLE_GRAPH_STR, None)
    if not text and source:
        text = getattr(compiled, SOURCE_CODE, None)
    return text or ""


def graph_callable(compiled: Any) -> Any:
    """The callable every run of a ``CompiledFxGraph`` goes through (``current_callable``), or None."""
    return getattr(compiled, CURRENT_CALLABLE, None)


def graph_callable_is_own(compiled: Any) -> bool:
    """The graph holds that callable in its own ``__dict__`` (it can be wrapped there, and put back)."""
    return CURRENT_CALLABLE in getattr(compiled, "__dict__", {})


def graph_uses_cudagraphs(compiled: Any) -> bool:
    """The graph runs as CUDA graphs (``cudagraph_info`` set)."""
    return bool(getattr(compiled, CUDAGRAPH_INFO, None))


def dynamo_skips_frames(fn: Any, nested: bool) -> bool:
    """Tell Dynamo's frame hook never to compile ``fn``'s own frames (``nested``: nor any frame
    they call, as for a compiled graph's own calls), per code object, at no per-call cost. How
    Dynamo inlines ``fn`` when it traces a caller is unchanged. False where this torch has no such
    switch (``set_code_exec_strategy``, 2.7+)."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy  # lazy: torch loads on first use, never when this module is imported
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
    inner = getattr(callback, ORIG_CALLABLE, None)  # CatchErrorsWrapper -> ConvertFrameAssert
    return getattr(inner, ONE_GRAPH, None) is True


def graph_cache_key(compiled: Any) -> Optional[str]:
    """The FX graph cache key of a ``CompiledFxGraph`` (``cache_key``; ``_fx_graph_cache_key`` on
    older releases), or None."""
    return getattr(compiled, "cache_key", None) or getattr(compiled, FX_GRAPH_CACHE_KEY, None)


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


# --- watch() and compiled graphs (watching/, fused/inductor.py, fused/runs.py) ----------------


def graph_task_id() -> Any:
    """A function returning the id of the autograd backward pass running on this thread, -1
    outside one (``torch._C._current_graph_task_id``); on a torch without it, always -1."""
    import torch  # lazy: torch loads on first use, never when this module is imported

    return getattr(torch._C, GRAPH_TASK_ID, None) or (lambda: -1)


def at_trace_time(fn: Any) -> Any:
    """``fn`` (no arguments, returns an int) run for real when Dynamo traces a call to it, the
    result baked into the graph as a constant (``torch._dynamo.assume_constant_result``);
    without that Dynamo support, a function that does nothing."""
    try:
        import torch._dynamo  # lazy: torch loads on first use, never when this module is imported

        return torch._dynamo.assume_constant_result(fn)
    except Exception:  # pragma: no cover - very old torch
        return lambda: 0


def hooks_home(handle: Any) -> Callable[[], Any]:
    """A hook handle's weak reference to the dict that holds its hook (``hooks_dict_ref``)."""
    return getattr(handle, HOOKS_DICT_REF)


def hook_dicts(handle: Any) -> "list[Any]":
    """The dicts a hook handle's registration wrote in: its hook dict, then its extra dicts
    (with_kwargs, always_call), as weak-reference results (None where a dict is gone)."""
    return [ref() for ref in (getattr(handle, HOOKS_DICT_REF), *getattr(handle, EXTRA_DICT_REF))]


def hook_marks(handle: Any) -> Tuple[Any, ...]:
    """What registering put in the handle's extra dicts (with_kwargs, always_call) under its id:
    ``(weak reference to the dict, value)`` pairs; () where the handle does not say."""
    try:
        return tuple((ref, ref()[handle.id]) for ref in getattr(handle, EXTRA_DICT_REF) if handle.id in (ref() or {}))
    except Exception:
        return ()


def reinsert_hook(handle: Any, fn: Callable[..., Any], marks: Tuple[Any, ...]) -> bool:
    """Put a removed hook back under its old id, as registering put it (the hook in the
    handle's dict, the same values in its extra dicts: ``marks``, from ``hook_marks``). Why:
    Dynamo guards on the ids of always-called hooks, so a new registration (a new id) at each
    watch() entry recompiled every step. False where the handle does not look like that
    (another torch): the caller registers anew."""
    try:
        hooks = getattr(handle, HOOKS_DICT_REF)()
        if hooks is None or not marks or any(ref() is None for ref, _ in marks):
            return False
        hooks[handle.id] = fn
        for ref, value in marks:
            ref()[handle.id] = value
        return True
    except Exception:
        return False


def is_compile_wrapper(module: Any) -> bool:
    """``torch.compile(module)``'s ``OptimizedModule``: it holds the module as ``_orig_mod``."""
    return hasattr(module, ORIG_MOD) and hasattr(module, ORIG_CALLABLE)


def compiled_in_place(module: Any) -> bool:
    """``module.compile()`` was called: its ``__call__`` runs a compiled ``_call_impl``."""
    return getattr(module, COMPILED_CALL_IMPL, None) is not None


def wrapped_module(wrapper: Any) -> Any:
    """The module an ``OptimizedModule`` (being built) wraps; None for ``torch.compiler.disable(module)``,
    the same class around a ``DisableContext``, which compiles nothing."""
    attrs = wrapper.__dict__
    if type(attrs.get("dynamo_ctx")).__name__ == DISABLE_CONTEXT:
        return None
    return attrs.get(ORIG_MOD) or attrs.get(MODULES, {}).get(ORIG_MOD)


def lowering_node() -> Any:
    """The FX node Inductor is lowering now (``V.graph.current_node``), or None."""
    from torch._inductor.virtualized import V  # lazy: torch loads on first use, never when this module is imported

    return getattr(V.graph, "current_node", None)


def inductor_cache_dir() -> str:
    """Inductor's cache directory (``cache_dir()``: ``runtime.cache_dir_utils``, earlier
    ``runtime.runtime_utils``)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir  # lazy: torch loads on first use, never when this module is imported
    except ImportError:  # older layout
        from torch._inductor.runtime.runtime_utils import cache_dir  # lazy: torch loads on first use, never when this module is imported
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
    if prof is not None and isinstance(getattr(prof, PROFILER_FLAG, None), bool):
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
        size = int(getattr(mod, DEFAULT_BLOCK_SIZE, 128))
        return size, size


def _cp_block_mask(build: Callable[..., Any]) -> Callable[..., Any]:
    """``_create_cp_block_mask`` called one way on every release: 2.15 added a required
    ``BLOCK_SIZE`` before ``device_mesh`` (2.11 to 2.14 have none), so the mesh goes by keyword
    and the block size (default: the module's, 128) only where the signature names it."""
    try:
        takes_block_size = "BLOCK_SIZE" in inspect.signature(build).parameters
    except (TypeError, ValueError):
        takes_block_size = False

    def create_cp_block_mask(mask_mod: Callable[..., Any], B: int, H: int, Q_LEN: int, KV_LEN: int,
                             device_mesh: Any, block_size: Optional[Tuple[int, int]] = None, **kwargs: Any) -> Any:
        if takes_block_size:
            size = int(getattr(public_module(), DEFAULT_BLOCK_SIZE, 128))
            kwargs["BLOCK_SIZE"] = block_size or (size, size)
        return build(mask_mod, B, H, Q_LEN, KV_LEN, device_mesh=device_mesh, **kwargs)

    return create_cp_block_mask


def context_parallel_flex() -> types.SimpleNamespace:
    """PyTorch's private context parallelism for FlexAttention: ``ContextParallel`` (the
    ``ParallelStyle``; ``ContextParallel(seq_dim, ContextParallel.AttentionType.FLEX)``),
    ``create_cp_block_mask`` and ``shard`` (``_context_parallel_shard``), from the first of
    ``CP_MODULES`` that has all three (tests/gpu/dist_cuda_worker.py, docs/distributed.md)."""
    errors = []
    for name in CP_MODULES:
        try:
            mod = module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        found = [mod.__dict__.get(n) for n in (CONTEXT_PARALLEL, CP_BLOCK_MASK, CP_SHARD)]
        if all(callable(f) for f in found) and hasattr(found[0], "AttentionType"):
            build: Callable[..., Any] = found[1]  # type: ignore[assignment]  # (callable: checked above)
            return types.SimpleNamespace(ContextParallel=found[0], create_cp_block_mask=_cp_block_mask(build), shard=found[2])
        errors.append(f"{name}: no {CONTEXT_PARALLEL} with AttentionType, {CP_BLOCK_MASK} and {CP_SHARD}")
    raise LookupError("context parallelism for FlexAttention not found: " + "; ".join(errors))
