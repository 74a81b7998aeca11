"""Where FlexAttention's objects live: its modules, the higher-order operator and its dense kernel,
the autograd op, Inductor's lowerings and compiled graphs, functional tensors."""

from __future__ import annotations

import gc
import importlib
import itertools
import operator
import sys
import types
from typing import Any, Dict, Optional

from fusionguard.torch_internals.names import (
    AUTOGRAD_CACHE_HIT,
    COMPILE_TIMES,
    DEBUG_FLAG,
    DISPATCH_CACHE,
    DYNAMO_COUNTERS,
    DYNAMO_UTILS,
    FLEX_LOWERING_MODULES,
    FUNCTORCH_C,
    HOP_MODULE,
    INDUCTOR_COMPILE,
    IS_FUNCTIONAL_TENSOR,
    LOWERING_MODULE,
    OUTPUT_CODE_MODULES,
    POST_GRAD_GRAPH_STR,
    PUBLIC_MODULE,
    PY_KERNELS,
    RUNNABLE_GRAPH_STR,
)


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


def sees_graphs_compiled_before() -> bool:
    """False where a graph Inductor compiled before ``enable()`` cannot be found: this release's
    ``CompiledFxGraph`` keeps no graph text (torch 2.7; 2.8 added it) and Inductor has compiled
    (or loaded) a graph in this process. Not whether its module is loaded: ``enable()`` imports
    it. True when unsure."""
    for name in OUTPUT_CODE_MODULES:
        cls = getattr(sys.modules.get(name), "CompiledFxGraph", None)
        if isinstance(cls, type):
            fields = {n for klass in cls.__mro__ for n in getattr(klass, "__annotations__", {})}
            return bool(fields & {POST_GRAD_GRAPH_STR, RUNNABLE_GRAPH_STR}) or not _inductor_compiled()
    return True


def _inductor_compiled() -> bool:
    """Whether Inductor has compiled a graph, or loaded one from its caches, in this process
    (since the last ``torch._dynamo.reset()``, which drops the graphs too): Dynamo's timing of
    ``compile_fx_inner``, or AOTAutograd's cache hits. Yes when unsure (those tables not found)."""
    utils = sys.modules.get(DYNAMO_UTILS)
    if utils is None:
        return False  # (nothing compiled: Dynamo never loaded)
    times, counters = getattr(utils, COMPILE_TIMES, None), getattr(utils, DYNAMO_COUNTERS, None)
    if not isinstance(times, dict) or not isinstance(counters, dict):
        return True
    group, key = AUTOGRAD_CACHE_HIT
    hits = counters.get(group)
    return bool(times.get(INDUCTOR_COMPILE)) or bool(hits is not None and hits.get(key))


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
        from torch._subclasses.functional_tensor import (
            FunctionalTensor,
        )  # lazy: torch loads on first use, never when this module is imported

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
